//! Adversarial multi-threaded probes of the memory layer, the way an inference server or a
//! data-parallel trainer drives it: eight threads sharing one caching allocator (a private one
//! and the process default), each on its own stream, handing buffers to another thread's stream
//! and dropping them on a third thread; disjoint views of one buffer written by eight threads on
//! eight streams; pinned buffers from a shared pool and the default pool on eight threads. Every
//! byte is checked and the allocators' books must come back to where they started.

use std::sync::mpsc;
use std::sync::{Arc, Barrier, Mutex};

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::{Buffer, CachingAllocator, DeviceBuffer, PinnedBuffer, PinnedPool};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const THREADS: usize = 8;

fn stream(context: &Arc<Context>) -> Arc<Stream> {
    Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream"))
}

/// A 64-bit LCG: the same "random" program on every run.
fn next(state: &mut u64) -> usize {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) as usize
}

/// An element count: mostly small (512 B .. 1 MiB), one in four large (2 .. 34 MiB), odd sizes.
fn mixed_len(state: &mut u64) -> usize {
    if next(state).is_multiple_of(4) {
        (2 * MIB + next(state) % (32 * MIB)) / 4 + 1
    } else {
        (512 + next(state) % MIB) / 4 + 1
    }
}

/// A value unique to a thread and an iteration.
fn tag(thread: usize, iteration: usize) -> u32 {
    0xA000_0000 | ((thread as u32) << 16) | iteration as u32
}

/// Adds one to every element of `buffer` on `stream` with a kernel, ordered with its other uses.
fn increment(kernels: &TestKernels, buffer: &DeviceBuffer<u32>, stream: &Stream) {
    buffer.prepare_use(stream).expect("prepare_use");
    // SAFETY: `buffer` holds `len` u32s; its use is recorded right after, so neither another
    // stream's use nor its free can overlap the kernel.
    unsafe { kernels.increment_u32(stream, buffer.device_ptr(), buffer.len()) }.expect("increment");
    buffer.record_use(stream).expect("record_use");
}

/// What a producer thread hands to the next thread's stream.
struct Handoff {
    buffer: DeviceBuffer<u32>,
    expected: u32,
}

#[derive(Clone, Copy, Debug)]
enum Which {
    Private,
    Default,
}

fn allocate(
    which: Which,
    allocator: &CachingAllocator,
    len: usize,
    stream: &Stream,
) -> DeviceBuffer<u32> {
    match which {
        Which::Private => allocator
            .buffer::<u32>(len, stream)
            .expect("private buffer"),
        Which::Default => DeviceBuffer::<u32>::new_on(stream, len).expect("default buffer"),
    }
}

/// Eight threads, each on its own stream: allocate a mixed size, fill it with a pattern of its
/// own (memset then kernel), hand it to the next thread, whose stream copies it into a buffer
/// of its own and checks every element, and which hands the original on to a third thread that
/// drops it. At the end every byte allocated is back, and `empty_cache` (private allocator)
/// returns every segment.
fn buffers_cross_three_threads(test: &str, which: Which) {
    const ITERATIONS: usize = 12;
    let gpu = require_gpu!(name = test);
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let allocator = match which {
        Which::Private => CachingAllocator::with_driver(&context),
        Which::Default => CachingAllocator::for_device(gpu.device).expect("default allocator"),
    };
    let before = allocator.stats();
    let streams: Vec<Arc<Stream>> = (0..THREADS).map(|_| stream(&context)).collect();
    let (handoff_tx, handoff_rx): (Vec<_>, Vec<_>) =
        (0..THREADS).map(|_| mpsc::channel::<Handoff>()).unzip();
    let (drop_tx, drop_rx): (Vec<_>, Vec<_>) = (0..THREADS)
        .map(|_| mpsc::channel::<DeviceBuffer<u32>>())
        .unzip();
    let start = Arc::new(Barrier::new(THREADS));

    let threads: Vec<_> = handoff_rx
        .into_iter()
        .zip(drop_rx)
        .enumerate()
        .map(|(thread, (inbox, drops))| {
            let own = streams[thread].clone();
            let to_next = handoff_tx[(thread + 1) % THREADS].clone();
            let to_dropper = drop_tx[(thread + 2) % THREADS].clone();
            let (allocator, kernels, start) = (allocator.clone(), kernels.clone(), start.clone());
            std::thread::spawn(move || {
                let mut rng = 0x1234_5678_u64 + thread as u64 * 7919;
                let (mut received, mut dropped, mut checked) = (0usize, 0usize, 0usize);
                let mut consume = |handoff: Handoff, own: &Stream| {
                    let Handoff { buffer, expected } = handoff;
                    let mut copy = allocate(which, &allocator, buffer.len(), own);
                    copy.copy_from_async(&buffer, own)
                        .expect("cross-stream copy");
                    // The original goes to a third thread, which drops it while our stream may
                    // still be reading it.
                    to_dropper.send(buffer).expect("dropper alive");
                    let host = copy
                        .copy_to_host_async(vec![0u32; copy.len()], own)
                        .expect("download")
                        .wait()
                        .expect("download finished");
                    let bad = host.iter().filter(|&&x| x != expected).count();
                    assert_eq!(bad, 0, "thread {thread}: {bad} elements not {expected:#x}");
                    checked += host.len();
                };
                start.wait();
                for iteration in 0..ITERATIONS {
                    let len = mixed_len(&mut rng);
                    let value = tag(thread, iteration);
                    let mut buffer = allocate(which, &allocator, len, &own);
                    buffer.fill_async(value, &own).expect("fill");
                    increment(&kernels, &buffer, &own);
                    to_next
                        .send(Handoff {
                            buffer,
                            expected: value + 1,
                        })
                        .expect("next thread alive");
                    while let Ok(handoff) = inbox.try_recv() {
                        consume(handoff, &own);
                        received += 1;
                    }
                    while let Ok(buffer) = drops.try_recv() {
                        drop(buffer);
                        dropped += 1;
                    }
                }
                while received < ITERATIONS {
                    consume(inbox.recv().expect("handoff"), &own);
                    received += 1;
                }
                while dropped < ITERATIONS {
                    drop(drops.recv().expect("buffer to drop"));
                    dropped += 1;
                }
                checked
            })
        })
        .collect();
    drop((handoff_tx, drop_tx));
    let checked: usize = threads
        .into_iter()
        .map(|thread| thread.join().expect("thread"))
        .sum();
    assert!(checked > 0);
    for stream in &streams {
        stream.synchronize().expect("synchronize");
    }
    let after = allocator.stats();
    assert_eq!(
        after.allocated_bytes.current, before.allocated_bytes.current,
        "every buffer's bytes are back: {after:?}"
    );
    assert_eq!(
        after.allocations - before.allocations,
        after.frees - before.frees,
        "as many frees as allocations"
    );
    assert_eq!(
        after.allocations - before.allocations,
        (2 * THREADS * ITERATIONS) as u64
    );
    if let Which::Private = which {
        let released = allocator.empty_cache().expect("empty_cache");
        let emptied = allocator.stats();
        assert_eq!(
            released, after.reserved_bytes.current,
            "empty_cache gives back every reserved byte"
        );
        assert_eq!(emptied.reserved_bytes.current, 0);
        assert_eq!(emptied.segments.current, 0);
        assert_eq!(emptied.active_bytes.current, 0);
        assert_eq!(allocator.pending_frees(), 0);
    }
}

#[test]
fn eight_threads_hand_private_cache_buffers_across_streams_and_drop_them_on_a_third() {
    let _serial = serial();
    buffers_cross_three_threads(
        "eight_threads_hand_private_cache_buffers_across_streams_and_drop_them_on_a_third",
        Which::Private,
    );
}

#[test]
fn eight_threads_hand_default_cache_buffers_across_streams_and_drop_them_on_a_third() {
    let _serial = serial();
    buffers_cross_three_threads(
        "eight_threads_hand_default_cache_buffers_across_streams_and_drop_them_on_a_third",
        Which::Default,
    );
}

/// One buffer, eight ranges of an odd length, each rewritten in rounds by its own thread on its
/// own stream (a memset and a kernel through a writable view, queued under a lock held only
/// while queueing); each thread downloads its own range every round while the others write
/// theirs; at the end the whole buffer, read on a ninth stream, holds every thread's last round.
#[test]
fn disjoint_views_written_by_eight_threads_on_eight_streams_read_back_whole() {
    const CHUNK: usize = 256 * KIB + 3;
    const ROUNDS: usize = 16;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let reader = stream(&context);
    let mut whole = DeviceBuffer::<u32>::new_on(&reader, CHUNK * THREADS).expect("buffer");
    whole.fill_async(0, &reader).expect("zero");
    let shared = Arc::new(Mutex::new(whole));
    let start = Arc::new(Barrier::new(THREADS));

    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (shared, kernels, start) = (shared.clone(), kernels.clone(), start.clone());
            let own = stream(&context);
            std::thread::spawn(move || {
                let range = thread * CHUNK..(thread + 1) * CHUNK;
                start.wait();
                for round in 0..ROUNDS {
                    let value = tag(thread, round);
                    let pending = {
                        let mut whole = shared.lock().unwrap();
                        let mut view = whole.slice_mut(range.clone()).expect("view");
                        view.fill_async(value, &own).expect("fill view");
                        view.prepare_use(&own).expect("prepare");
                        // SAFETY: the view holds CHUNK u32s of the buffer, which outlives the
                        // test's end; its use is recorded right after.
                        unsafe { kernels.increment_u32(&own, view.device_ptr(), CHUNK) }
                            .expect("increment view");
                        view.record_use(&own).expect("record");
                        whole
                            .slice(range.clone())
                            .expect("read view")
                            .copy_to_host_async(vec![0u32; CHUNK], &own)
                            .expect("download own range")
                    };
                    let host = pending.wait().expect("downloaded");
                    let bad = host.iter().filter(|&&x| x != value + 1).count();
                    assert_eq!(
                        bad, 0,
                        "thread {thread} round {round}: {bad} elements wrong"
                    );
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread");
    }
    let whole = Arc::into_inner(shared).unwrap().into_inner().unwrap();
    let host = whole
        .copy_to_host_async(vec![0u32; CHUNK * THREADS], &reader)
        .expect("download whole")
        .wait()
        .expect("downloaded");
    for thread in 0..THREADS {
        let expected = tag(thread, ROUNDS - 1) + 1;
        let bad = host[thread * CHUNK..(thread + 1) * CHUNK]
            .iter()
            .filter(|&&x| x != expected)
            .count();
        assert_eq!(bad, 0, "range {thread}: {bad} elements not its last round");
    }
}

/// Eight threads upload from pinned buffers (a shared private pool on even iterations, the
/// default pool through `PinnedBuffer::new` on odd ones) into buffers on their own streams, add
/// one on the device, and download into another pinned buffer; each thread checks its own bytes.
/// The private pool ends with nothing handed out and as many returns as gets.
#[test]
fn pinned_buffers_from_eight_threads_round_trip_their_own_bytes() {
    const ITERATIONS: usize = 20;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let pool = PinnedPool::new(&context);
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (pool, kernels, start) = (pool.clone(), kernels.clone(), start.clone());
            let context = context.clone();
            std::thread::spawn(move || {
                let own = stream(&context);
                let mut rng = 0xBEEF_u64 + thread as u64;
                let mut pooled = 0u64;
                start.wait();
                for iteration in 0..ITERATIONS {
                    let len = (4 * KIB + next(&mut rng) % (4 * MIB)) / 4 + 1;
                    let pinned = |pooled: &mut u64| {
                        if iteration % 2 == 0 {
                            *pooled += 1;
                            pool.buffer::<u32>(len).expect("pooled pinned")
                        } else {
                            PinnedBuffer::<u32>::new(&context, len).expect("default pinned")
                        }
                    };
                    let mut up = pinned(&mut pooled);
                    let base = tag(thread, iteration);
                    for (i, x) in up.as_mut_slice().expect("host side").iter_mut().enumerate() {
                        *x = base ^ (i as u32).wrapping_mul(0x9E37_79B9);
                    }
                    let down = pinned(&mut pooled);
                    let mut device = DeviceBuffer::<u32>::new_on(&own, len).expect("device");
                    let up = device
                        .copy_from_host_async(up, &own)
                        .expect("upload")
                        .wait()
                        .expect("uploaded");
                    increment(&kernels, &device, &own);
                    let down = device
                        .copy_to_host_async(down, &own)
                        .expect("download")
                        .wait()
                        .expect("downloaded");
                    let (up, down) = (
                        up.as_slice().expect("up").to_vec(),
                        down.as_slice().expect("down").to_vec(),
                    );
                    let bad = up
                        .iter()
                        .zip(&down)
                        .filter(|(a, b)| a.wrapping_add(1) != **b)
                        .count();
                    assert_eq!(bad, 0, "thread {thread} iteration {iteration}: {bad} wrong");
                }
                own.synchronize().expect("synchronize");
                pooled
            })
        })
        .collect();
    let pooled: u64 = threads.into_iter().map(|t| t.join().expect("thread")).sum();
    let stats = pool.stats();
    assert_eq!(
        stats.allocated_blocks, 0,
        "every pooled block came back: {stats:?}"
    );
    assert_eq!(stats.allocated_bytes, 0);
    assert_eq!(stats.gets, pooled, "one get per pooled buffer");
    assert_eq!(stats.returns, stats.gets, "one return per get");
}
