//! A fifth look at the driver layer through what cudarc users write, aimed at the newest code
//! and at the seams between features: `Context::synchronize` and plain allocations made on one
//! thread while another thread begins and ends global captures over and over (the check of
//! "is a capture active" and the driver call after it are two steps), a thread-local capture
//! held open while another thread synchronises, allocates, waits on completion words and pooled
//! events, the 4-byte alignment check of the 32-bit memsets inside a capture, a private memory
//! pool dropped with a block still out, release thresholds across two streams, one executable
//! updated to new buffers and relaunched two thousand times on two streams, and host functions
//! on eight threads consuming pinned copies. Each test checks its outcome: exact counts and
//! bytes, typed errors matched by variant, captures that end valid.

mod common;

use common::{
    CaptureRounds, assert_invalid, non_blocking, pools_supported, read_bytes, read_u32,
    warmed_kernels,
};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cuweave_driver::memory::{
    self, CompletionWords, DeviceAllocation, DevicePtr, HostAllocFlags, HostAllocation, MemoryPool,
    MemoryType,
};
use cuweave_driver::{
    CaptureMode, Context, DriverError, EventPool, GraphError, GraphNodeType, InstantiateOptions,
    Stream,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

/// What a thread making calls beside a capturing thread saw.
#[derive(Debug, Default)]
struct Beside {
    ok: usize,
    refused: usize,
    /// Errors other than a capture refusal: the call reached the driver while a capture was
    /// active and the driver refused it (and broke the capture).
    other: Vec<String>,
}

/// Begins and ends global captures of one increment on `stream`, on this thread, for up to
/// `rounds` rounds or `limit`, while another thread makes `call` in a loop; then replays a few
/// of the graphs. Returns what the capturing thread saw break and what the other thread saw.
///
/// A global capture forbids unsafe calls (a context synchronisation, `cuMemAlloc`) on every
/// thread not in relaxed mode: cuweave refuses them while it counts a capture as active, or
/// makes them in relaxed mode. Whichever it does, no round's capture may come out broken.
fn race_global_captures(
    context: &Arc<Context>,
    rounds: usize,
    limit: Duration,
    call: impl Fn() -> Result<(), DriverError> + Sync,
) -> (Vec<String>, Beside) {
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let stop = AtomicBool::new(false);
    let started = Barrier::new(2);
    let mut capture = CaptureRounds::default();
    let beside = std::thread::scope(|scope| {
        let other = scope.spawn(|| {
            let mut seen = Beside::default();
            started.wait();
            while !stop.load(Ordering::Acquire) {
                match call() {
                    Ok(()) => seen.ok += 1,
                    Err(error) if error.is_capture_refusal() => seen.refused += 1,
                    Err(error) => {
                        if seen.other.len() < 8 {
                            seen.other.push(error.to_string());
                        }
                    }
                }
            }
            seen
        });
        started.wait();
        let deadline = Instant::now() + limit;
        let mut round = 0;
        while round < rounds && Instant::now() < deadline {
            round += 1;
            capture.capture_increment(&stream, &kernels, counter.ptr(), round, 256);
        }
        stop.store(true, Ordering::Release);
        other.join().unwrap()
    });
    stream.synchronize().unwrap();
    assert_eq!(
        read_u32(context, counter.ptr(), 1, &stream),
        [capture.replayed],
        "each replayed graph incremented once, and nothing captured ran eagerly"
    );
    (capture.broken, beside)
}

// ---------------------------------------------------------------------------------------------
// Context::synchronize and allocations beside captures on other threads
// ---------------------------------------------------------------------------------------------

/// A training loop that captures its step in global mode (PyTorch's default capture mode) on
/// one thread while a monitoring thread calls `torch.cuda.synchronize()` in a loop (here
/// `Context::synchronize`). cuweave refuses a context synchronisation while it counts a capture
/// as active; the check and the `cuCtxSynchronize` after it must not let a capture that begins
/// in between be broken by the synchronisation (as `begin_capture_synchronized` and the
/// retirement thread guard theirs with `while_no_capture_begins`). Checks: every capture of
/// 4000 ends valid, the other thread sees only successes and typed refusals, and the replayed
/// graphs count exactly.
#[test]
fn context_synchronize_on_another_thread_never_breaks_global_captures_begun_beside_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (broken, beside) = race_global_captures(context, 4000, Duration::from_secs(4), || {
        context.synchronize()
    });
    assert!(
        broken.is_empty() && beside.other.is_empty(),
        "{} of the captures broke (first: {:?}); the synchronising thread's driver errors: {:?} \
         ({} synchronised, {} refused)",
        broken.len(),
        broken.first(),
        beside.other,
        beside.ok,
        beside.refused
    );
    assert!(
        beside.ok + beside.refused > 0,
        "the other thread made calls"
    );
    // With every capture over, a synchronisation is plain again.
    context.synchronize().unwrap();
}

/// A data loader that allocates and frees scratch device memory (`cuMemAlloc` / `cuMemFree`
/// through `DeviceAllocation`) on its own thread while the model thread captures global-mode
/// graphs over and over. `DeviceAllocation::new` documents that it works while a capture is
/// active (relaxed mode), but it decides whether to enter relaxed mode from the capture count
/// before calling the driver: a global capture begun in between sees a plain `cuMemAlloc`.
/// Checks: every capture ends valid and every allocation succeeds or is a typed refusal.
#[test]
fn allocations_on_another_thread_never_break_global_captures_begun_beside_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (broken, beside) = race_global_captures(context, 4000, Duration::from_secs(4), || {
        drop(DeviceAllocation::new(context, 64 << 10)?);
        Ok(())
    });
    assert!(
        broken.is_empty() && beside.other.is_empty(),
        "{} of the captures broke (first: {:?}); the allocating thread's driver errors: {:?} \
         ({} allocated, {} refused)",
        broken.len(),
        broken.first(),
        beside.other,
        beside.ok,
        beside.refused
    );
    assert!(beside.ok > 0, "allocations beside captures succeed");
}

/// An inference server that captures a request's graph on one thread in thread-local mode
/// (cuweave's default) and keeps serving on another thread meanwhile: a context
/// synchronisation (refused or done, never breaking), a kernel and a completion-word wait on its
/// own stream, a pooled event recorded and waited, a plain allocation and a blocking 32-bit
/// memset and copy. Checks: the serving thread's work all succeeds with exact bytes, the capture
/// ends valid and its graph replays 1000 times exactly, and afterwards `Context::synchronize`
/// succeeds on both threads.
#[test]
fn a_thread_local_capture_held_open_while_another_thread_synchronises_and_serves_stays_valid() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let words = CompletionWords::new(context).unwrap();
    let events = EventPool::for_context(context).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    std::thread::scope(|scope| {
        let server = scope.spawn(|| {
            let synchronised = context.synchronize();
            assert!(
                matches!(
                    &synchronised,
                    Ok(()) | Err(DriverError::Graph(GraphError::Capturing { .. }))
                ),
                "a context synchronisation beside a thread-local capture: {synchronised:?}"
            );
            let own = non_blocking(context);
            const N: usize = 4096;
            let buffer = DeviceAllocation::new(context, N * 4).unwrap();
            for round in 0..50u32 {
                // SAFETY: `buffer` holds N u32s and is read only after the wait below.
                unsafe { kernels.fill_u32(&own, buffer.ptr(), 0xB0B0_0000 + round, N) }.unwrap();
                words.synchronize(&own).unwrap();
                let mut host = vec![0u8; N * 4];
                // SAFETY: `host` holds N * 4 bytes; the fill has finished.
                unsafe { memory::copy_dtoh(context, host.as_mut_ptr(), buffer.ptr(), N * 4) }
                    .unwrap();
                assert!(
                    host.chunks_exact(4)
                        .all(|w| u32::from_ne_bytes(w.try_into().unwrap()) == 0xB0B0_0000 + round),
                    "round {round}: the completion word returned before the fill"
                );
                let done = events.acquire_owned(false).unwrap();
                kernels.spin_ns(&own, 2_000).unwrap();
                done.record(&own).unwrap();
                done.synchronize().unwrap();
                assert!(done.query().unwrap());
            }
            // SAFETY: `buffer` holds N u32s; nothing else uses it.
            unsafe { memory::memset_d32(context, buffer.ptr(), 0x0102_0304, N) }.unwrap();
            assert_eq!(
                read_u32(context, buffer.ptr(), N, &own),
                vec![0x0102_0304; N]
            );
        });
        // The capturing thread keeps recording while the server works.
        for _ in 0..3 {
            // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
            unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
        }
        server.join().unwrap()
    });
    let graph = stream
        .end_capture()
        .expect("the capture survived the serving thread");
    assert_eq!(graph.node_types().unwrap(), vec![GraphNodeType::Kernel; 3]);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.upload(&stream).unwrap();
    for _ in 0..1000 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [3000]);
    assert_eq!(exec.launch_count(), 1000);
    context.synchronize().unwrap();
    std::thread::scope(|scope| scope.spawn(|| context.synchronize()).join().unwrap()).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Memsets of every width
// ---------------------------------------------------------------------------------------------

/// A cudarc user fills `u8`, `f16` and `u32` slices at element offsets inside one buffer, some
/// of them misaligned by mistake, while capturing the fills into a graph. Checks: every 32-bit
/// memset at an address that is not 4-byte aligned (offsets 1, 2, 3, 6) and every 16-bit one at
/// an odd address is `InvalidArgument`, sync or async, inside the capture or not, without
/// writing a byte or breaking the capture; blocking memsets on the capturing thread are typed
/// refusals; the graph holds exactly the three valid memsets and, replayed twice over a zeroed
/// buffer, writes exactly what a host model says.
#[test]
fn misaligned_memsets_are_refused_inside_a_capture_and_the_graph_holds_only_the_aligned_ones() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    const SIZE: usize = 256;
    let buffer = DeviceAllocation::zeroed(context, SIZE).unwrap();
    let base = buffer.ptr();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    for offset in [1u64, 2, 3, 6, 250] {
        // SAFETY: inside the buffer; refused before the driver is asked.
        assert_invalid(
            unsafe { memory::memset_d32_async(base + offset, 0xdead_beef, 1, &stream) },
            &format!("memset_d32_async at +{offset}"),
        );
    }
    for offset in [1u64, 3, 255] {
        // SAFETY: inside the buffer; refused before the driver is asked.
        assert_invalid(
            unsafe { memory::memset_d16_async(base + offset, 0xbeef, 0, &stream) },
            &format!("memset_d16_async at +{offset}"),
        );
    }
    // Blocking forms on the capturing thread: refused one way or the other, never run.
    // SAFETY: inside the buffer.
    match unsafe { memory::memset_d32(context, base + 2, 7, 4) } {
        Err(DriverError::InvalidArgument { .. }) => {}
        Err(error) if error.is_capture_refusal() => {}
        other => panic!("a blocking misaligned memset_d32 during a capture: {other:?}"),
    }
    // SAFETY: inside the buffer.
    let blocking = unsafe { memory::memset_d8(context, base, 7, 4) };
    assert!(
        matches!(&blocking, Err(error) if error.is_capture_refusal()),
        "a blocking memset on the capturing thread: {blocking:?}"
    );
    let mut model = vec![0u8; SIZE];
    // SAFETY: each range lies inside the buffer, which outlives the graph's launches.
    unsafe {
        memory::memset_d8_async(base + 1, 0x11, 5, &stream).unwrap();
        memory::memset_d16_async(base + 10, 0x2233, 7, &stream).unwrap();
        memory::memset_d32_async(base + 32, 0x4455_6677, 9, &stream).unwrap();
    }
    model[1..6].fill(0x11);
    for chunk in model[10..24].chunks_exact_mut(2) {
        chunk.copy_from_slice(&0x2233u16.to_ne_bytes());
    }
    for chunk in model[32..68].chunks_exact_mut(4) {
        chunk.copy_from_slice(&0x4455_6677u32.to_ne_bytes());
    }
    let graph = stream
        .end_capture()
        .expect("refused memsets leave the capture valid");
    assert_eq!(graph.node_types().unwrap(), vec![GraphNodeType::Memset; 3]);
    // Nothing ran while capturing, and nothing refused wrote.
    assert_eq!(read_bytes(context, base, SIZE, &stream), vec![0u8; SIZE]);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.launch(&stream).unwrap();
    exec.launch(&stream).unwrap();
    assert_eq!(read_bytes(context, base, SIZE, &stream), model);
    // Outside the capture the blocking misaligned forms are still refused and write nothing.
    for offset in [1u64, 2, 3] {
        // SAFETY: inside the buffer; refused before the driver is asked.
        assert_invalid(
            unsafe { memory::memset_d32(context, base + offset, 0, 8) },
            &format!("memset_d32 at +{offset}"),
        );
    }
    // SAFETY: inside the buffer; refused before the driver is asked.
    assert_invalid(
        unsafe { memory::memset_d16(context, base + 1, 0, 8) },
        "memset_d16 at +1",
    );
    assert_eq!(read_bytes(context, base, SIZE, &stream), model);
}

// ---------------------------------------------------------------------------------------------
// Stream-ordered memory pools
// ---------------------------------------------------------------------------------------------

/// A cudarc user makes a private pool, hands a block of it to a longer-lived structure, and
/// drops the pool first (`cuMemPoolDestroy` with a block outstanding returns at once and frees
/// the pool once the block is freed). Checks: pointer attributes of the block's start and middle
/// say device memory of this device, not managed, and its address range lies inside the block;
/// the block stays usable after the pool's drop, bytes round-trip, and its free succeeds.
#[test]
fn a_block_outlives_its_dropped_private_pool_and_reports_device_attributes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    if !pools_supported(context) {
        return;
    }
    let stream = non_blocking(context);
    let pool = MemoryPool::new(context).unwrap();
    const BYTES: usize = (3 << 20) + 13;
    // SAFETY: freed once, below, on `stream`.
    let block = unsafe { pool.alloc_async(BYTES, &stream) }.unwrap();
    stream.synchronize().unwrap();
    let used = pool.used_bytes().unwrap();
    assert!(
        used >= BYTES as u64,
        "{used} bytes used for a {BYTES}-byte block"
    );
    for at in [
        block,
        block + (BYTES as u64) / 2 + 1,
        block + BYTES as u64 - 1,
    ] {
        let attributes = memory::pointer_attributes(at).unwrap();
        assert_eq!(attributes.memory_type, MemoryType::Device, "{at:#x}");
        assert_eq!(attributes.device_ordinal, context.device().ordinal() as i32);
        assert!(!attributes.is_managed);
    }
    drop(pool);
    let pattern: Vec<u8> = (0..BYTES).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: `block` is a live BYTES-byte block; `pattern` outlives the synchronisation below.
    unsafe { memory::copy_htod_async(block, pattern.as_ptr(), BYTES, &stream) }.unwrap();
    // SAFETY: the block's last 3 bytes, ordered after the copy on the same stream.
    unsafe { memory::memset_d8_async(block + BYTES as u64 - 3, 0xee, 3, &stream) }.unwrap();
    let mut expected = pattern.clone();
    expected[BYTES - 3..].fill(0xee);
    assert!(
        read_bytes(context, block, BYTES, &stream) == expected,
        "the block's bytes"
    );
    // SAFETY: nothing uses `block` afterwards.
    unsafe { memory::free_async(block, &stream) }.unwrap();
    stream.synchronize().unwrap();
}

/// A serving loop keeps a private pool's freed memory cached (release threshold `u64::MAX`, as
/// RMM's `cuda_async_memory_resource` does) and hands 1 MiB blocks back and forth between two
/// streams, each allocation ordered after the other stream's free by an event, 600 times.
/// Checks: the threshold reads back; used bytes are exactly the live block while one is out;
/// reserved memory stays bounded (freed blocks are reused across the streams, not piled up) and
/// stays cached after synchronisation; `trim_to(0)` then gives everything back; values written
/// through each block are exact.
#[test]
fn a_cached_pool_reuses_blocks_across_two_streams_stays_bounded_and_trims_to_nothing() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    if !pools_supported(context) {
        return;
    }
    let streams = [non_blocking(context), non_blocking(context)];
    let kernels: TestKernels = warmed_kernels(context, &streams[0]);
    let pool = MemoryPool::new(context).unwrap();
    pool.set_release_threshold(u64::MAX).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX);
    const BYTES: usize = 1 << 20;
    const N: usize = BYTES / 4;
    let events = EventPool::for_context(context).unwrap();
    let mut freed = events.acquire_owned(false).unwrap();
    freed.record(&streams[1]).unwrap();
    let mut most_reserved = 0;
    for round in 0..600usize {
        let stream = &streams[round % 2];
        stream.wait_event(&freed).unwrap();
        // SAFETY: freed once, below, on the same stream.
        let block = unsafe { pool.alloc_async(BYTES, stream) }.unwrap();
        // SAFETY: `block` holds N u32s, live until its free below on the same stream.
        unsafe { kernels.fill_u32(stream, block, round as u32, N) }.unwrap();
        if round % 60 == 0 {
            let used = pool.used_bytes().unwrap();
            assert!(
                (BYTES as u64..4 * BYTES as u64).contains(&used),
                "round {round}: {used} bytes used for one live 1 MiB block"
            );
            let words = read_u32(context, block, N, stream);
            assert!(words.iter().all(|&w| w == round as u32), "round {round}");
            most_reserved = most_reserved.max(pool.reserved_bytes().unwrap());
        }
        // SAFETY: nothing ordered after this uses `block`.
        unsafe { memory::free_async(block, stream) }.unwrap();
        freed = events.acquire_owned(false).unwrap();
        freed.record(stream).unwrap();
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    assert_eq!(pool.used_bytes().unwrap(), 0);
    assert!(
        most_reserved <= 64 << 20,
        "{most_reserved} bytes reserved for one live 1 MiB block at a time"
    );
    assert!(
        pool.reserved_bytes().unwrap() >= BYTES as u64,
        "a u64::MAX threshold keeps freed memory cached past synchronisation"
    );
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0, "trimmed to nothing");
}

/// A caching allocator tunes and trims its private pool while the model thread captures (an
/// `empty_cache()` or a threshold change that lands mid-capture, and a new pool made on first
/// use, which the graph crate documents as allowed): on the capturing thread, with a
/// thread-local capture open, set and read the release threshold, read reserved and used bytes,
/// trim, and make and drop a second pool. Checks: each call succeeds or is a typed capture
/// refusal, the capture ends valid, and its graph increments exactly once per launch.
#[test]
fn pool_housekeeping_on_the_capturing_thread_keeps_the_capture() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    if !pools_supported(context) {
        return;
    }
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let pool = MemoryPool::new(context).unwrap();
    // SAFETY: freed right below; the pool then caches the block's memory.
    let warm = unsafe { pool.alloc_async(1 << 20, &stream) }.unwrap();
    // SAFETY: nothing uses `warm` afterwards.
    unsafe { memory::free_async(warm, &stream) }.unwrap();
    stream.synchronize().unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
    unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
    fn allowed<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
        match result {
            Ok(_) => {}
            Err(error) if error.is_capture_refusal() => {}
            Err(error) => panic!("{what} during a capture: {error}"),
        }
    }
    allowed(
        pool.set_release_threshold(u64::MAX),
        "set_release_threshold",
    );
    allowed(pool.release_threshold(), "release_threshold");
    allowed(pool.reserved_bytes(), "reserved_bytes");
    allowed(pool.used_bytes(), "used_bytes");
    allowed(pool.trim_to(0), "trim_to");
    let second = MemoryPool::new(context).expect("a pool made during a capture");
    allowed(
        second.set_release_threshold(1 << 20),
        "a second pool's threshold",
    );
    drop(second);
    // SAFETY: `counter` as above.
    unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
    let graph = stream
        .end_capture()
        .expect("pool housekeeping left the capture valid");
    assert_eq!(graph.node_count().unwrap(), 2);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..50 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [100]);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0);
}

// ---------------------------------------------------------------------------------------------
// Raw interop
// ---------------------------------------------------------------------------------------------

/// Two libraries share one `CUstream`: cuweave's handle begins a capture, and a borrowed handle
/// (`Stream::from_raw` with `owned: false`, what a cudarc interop layer makes from `as_raw`)
/// is used on it meanwhile. Checks: a synchronisation through the alias is a typed refusal (the
/// stream is capturing), a begin through the alias fails without breaking the capture, an end
/// through the alias is `NotCapturing` and leaves the capture alone, dropping the alias ends
/// nothing, kernels queued through the alias are recorded, and the graph ended through the
/// owner replays them exactly; afterwards the alias works as a plain stream.
#[test]
fn a_borrowed_alias_of_a_capturing_stream_neither_ends_nor_breaks_its_capture() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    {
        // SAFETY: `stream` is live and outlives the alias, which does not own it.
        let alias = unsafe { Stream::from_raw(context, stream.as_raw(), false) };
        assert_eq!(alias.as_raw(), stream.as_raw());
        assert_ne!(alias.id(), stream.id());
        let synchronised = alias.synchronize();
        assert!(
            matches!(&synchronised, Err(error) if error.is_capture_refusal()),
            "synchronising a capturing stream through an alias: {synchronised:?}"
        );
        assert!(
            alias.begin_capture(CaptureMode::ThreadLocal).is_err(),
            "a second capture of one CUstream"
        );
        match alias.end_capture() {
            Err(DriverError::Graph(GraphError::NotCapturing { .. })) => {}
            other => panic!("ending through an alias: {other:?}"),
        }
        // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
        unsafe { kernels.increment_u32(&alias, counter.ptr(), 1) }.unwrap();
    }
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
    let graph = stream
        .end_capture()
        .expect("the alias left the capture valid");
    assert_eq!(graph.node_types().unwrap(), vec![GraphNodeType::Kernel; 2]);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    // SAFETY: as above; the alias does not own the stream.
    let alias = unsafe { Stream::from_raw(context, stream.as_raw(), false) };
    for _ in 0..100 {
        exec.launch(&alias).unwrap();
    }
    alias.synchronize().unwrap();
    drop(alias);
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [200]);
}

// ---------------------------------------------------------------------------------------------
// Graphs
// ---------------------------------------------------------------------------------------------

/// A cudarc graph user captures one increment kernel, instantiates it, and then for each of
/// four buffers updates the executable to point at that buffer (a fresh capture with changed
/// parameters), uploads it, and launches it 500 times alternating two streams. Checks: every
/// buffer counts exactly 500 (launches of one executable never overlap, updates reach only the
/// later launches), the first buffer is not touched again after the update away from it, and
/// the executable counts 2000 launches.
#[test]
fn one_executable_updated_to_four_buffers_and_relaunched_on_two_streams_counts_every_launch() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let streams = [non_blocking(context), non_blocking(context)];
    let kernels = warmed_kernels(context, &streams[0]);
    const N: usize = 1000;
    let buffers: Vec<DeviceAllocation> = (0..4)
        .map(|_| DeviceAllocation::zeroed(context, N * 4).unwrap())
        .collect();
    let capture = |target: DevicePtr| {
        let origin = &streams[0];
        origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: `target` holds N u32s and outlives every launch (synchronised below).
        unsafe { kernels.increment_u32(origin, target, N) }.unwrap();
        origin.end_capture().unwrap()
    };
    let mut exec = capture(buffers[0].ptr())
        .instantiate(&InstantiateOptions::default())
        .unwrap();
    for (index, buffer) in buffers.iter().enumerate() {
        if index > 0 {
            exec.update(&capture(buffer.ptr())).unwrap();
        }
        exec.upload(&streams[index % 2]).unwrap();
        for launch in 0..500 {
            exec.launch(&streams[launch % 2]).unwrap();
        }
    }
    for stream in &streams {
        stream.synchronize().unwrap();
    }
    for (index, buffer) in buffers.iter().enumerate() {
        let counts = read_u32(context, buffer.ptr(), N, &streams[0]);
        assert!(
            counts.iter().all(|&c| c == 500),
            "buffer {index}: {:?}",
            &counts[..8]
        );
    }
    assert_eq!(exec.launch_count(), 2000);
}

// ---------------------------------------------------------------------------------------------
// Host functions and threads
// ---------------------------------------------------------------------------------------------

/// The classic asynchronous download: eight threads, each with its own stream, fill a device
/// buffer, copy it into pinned host memory and queue a host function that checks the pinned
/// bytes (the copy before it has landed), 150 rounds each; every 50 rounds a thread calls
/// `Context::synchronize` while the others keep queueing. Checks: every host function ran once
/// and saw exactly its round's value, and each thread's last round is what its pinned buffer
/// holds.
#[test]
fn host_functions_on_eight_threads_see_the_pinned_copy_queued_before_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let warm = non_blocking(context);
    let kernels = warmed_kernels(context, &warm);
    const THREADS: usize = 8;
    const ROUNDS: u32 = 150;
    const N: usize = 2048;
    let ran = Arc::new(AtomicUsize::new(0));
    let wrong = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (kernels, ran, wrong) = (&kernels, Arc::clone(&ran), Arc::clone(&wrong));
            scope.spawn(move || {
                let stream = non_blocking(context);
                let device = DeviceAllocation::new(context, N * 4).unwrap();
                let mut pinned =
                    HostAllocation::new(context, N * 4, HostAllocFlags::default()).unwrap();
                let host = pinned.as_mut_ptr() as usize;
                for round in 0..ROUNDS {
                    let value = ((thread as u32) << 16) | round;
                    // SAFETY: `device` holds N u32s; `pinned` holds N * 4 bytes, both live
                    // until the stream is synchronised below.
                    unsafe {
                        kernels.fill_u32(&stream, device.ptr(), value, N).unwrap();
                        memory::copy_dtoh_async(host as *mut u8, device.ptr(), N * 4, &stream)
                            .unwrap();
                    }
                    let (ran, wrong) = (Arc::clone(&ran), Arc::clone(&wrong));
                    stream
                        .launch_host_fn(move || {
                            // SAFETY: the pinned buffer lives until the stream is synchronised
                            // below, and nothing writes it while this runs (the next copy is
                            // queued behind this function).
                            let bytes =
                                unsafe { std::slice::from_raw_parts(host as *const u8, N * 4) };
                            let exact = bytes
                                .chunks_exact(4)
                                .all(|w| u32::from_ne_bytes(w.try_into().unwrap()) == value);
                            if !exact {
                                wrong.fetch_add(1, Ordering::Relaxed);
                            }
                            ran.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap();
                    if round % 50 == 49 {
                        context.synchronize().unwrap();
                    }
                }
                stream.synchronize().unwrap();
                let last = ((thread as u32) << 16) | (ROUNDS - 1);
                assert!(
                    pinned
                        .as_bytes()
                        .chunks_exact(4)
                        .all(|w| u32::from_ne_bytes(w.try_into().unwrap()) == last),
                    "thread {thread}: the pinned buffer holds its last round"
                );
            });
        }
    });
    assert_eq!(ran.load(Ordering::Relaxed), THREADS * ROUNDS as usize);
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "host functions saw stale copies"
    );
}
