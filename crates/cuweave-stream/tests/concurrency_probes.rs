//! Adversarial multi-threaded probes of the stream layer: a stream pool shared by sixteen
//! threads under every allocation strategy, coordinator dependencies declared from eight threads
//! at once (proven by bytes copied across streams), a stream-ordered allocator whose memory is
//! freed by a consumer thread while its producer keeps allocating, and a graph captured on one
//! thread while seven others run eager work on other streams of the same context.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use cuweave_driver::memory::{copy_dtod_async, memset_d32_async};
use cuweave_driver::{InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_stream::capture::CaptureOptions;
use cuweave_stream::{
    AllocationStrategy, MultiStreamCoordinator, PriorityStream, StreamOrderedAllocator,
    StreamOrderedAllocatorConfig, StreamPool, StreamPoolConfig, StreamPriority,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip_under_sanitizer};

const MS: u64 = 1_000_000;

fn tag(thread: usize, iteration: usize) -> u32 {
    0xC000_0000 | ((thread as u32) << 16) | iteration as u32
}

/// Adds one to every element of `buffer` with a kernel queued through `stream` (counted as a
/// launch), ordered with the buffer's other uses.
fn increment(kernels: &TestKernels, buffer: &DeviceBuffer<u32>, stream: &PriorityStream) {
    buffer.prepare_use(stream.stream()).expect("prepare_use");
    stream
        // SAFETY: `buffer` holds `len` u32s; its use is recorded right after.
        .launch(|s| unsafe { kernels.increment_u32(s, buffer.device_ptr(), buffer.len()) })
        .expect("launch");
    buffer.record_use(stream.stream()).expect("record_use");
}

/// Sixteen threads share one pool per strategy; each takes a stream from it per iteration and
/// fills, increments, downloads and synchronizes there. Every element is checked, and the pool's
/// streams together count exactly the memsets and launches queued.
#[test]
fn sixteen_threads_share_a_stream_pool_under_every_strategy() {
    const THREADS: usize = 16;
    const ITERATIONS: usize = 10;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    for strategy in [
        AllocationStrategy::RoundRobin,
        AllocationStrategy::LoadBalanced,
        AllocationStrategy::Priority,
        AllocationStrategy::Workload,
    ] {
        let pool = Arc::new(
            StreamPool::new(&context, StreamPoolConfig::with_strategy(strategy)).expect("pool"),
        );
        let start = Arc::new(Barrier::new(THREADS));
        let threads: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (pool, kernels, start) = (pool.clone(), kernels.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    for iteration in 0..ITERATIONS {
                        let stream = pool.get_stream().expect("get_stream");
                        let len = 4096 + 977 * thread + 131 * iteration;
                        let mut buffer =
                            DeviceBuffer::<u32>::new_on(stream.stream(), len).expect("buffer");
                        let value = tag(thread, iteration);
                        stream.fill(&mut buffer, value).expect("fill");
                        increment(&kernels, &buffer, &stream);
                        let host = stream
                            .copy_to_host(&buffer, vec![0u32; len])
                            .expect("download")
                            .wait()
                            .expect("downloaded");
                        stream.synchronize().expect("synchronize");
                        let bad = host.iter().filter(|&&x| x != value + 1).count();
                        assert_eq!(
                            bad, 0,
                            "{strategy:?} thread {thread} iteration {iteration}: {bad} wrong"
                        );
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().expect("thread");
        }
        let (mut memsets, mut launches) = (0, 0);
        for stream in pool.streams() {
            stream.synchronize().expect("synchronize");
            let metrics = stream.metrics().expect("metrics");
            memsets += metrics.memsets;
            launches += metrics.kernel_launches;
        }
        let total = (THREADS * ITERATIONS) as u64;
        assert_eq!(memsets, total, "{strategy:?}: every fill counted once");
        assert_eq!(launches, total, "{strategy:?}: every launch counted once");
    }
}

/// Eight threads, one stream each: every stream fills its region behind a spin, then (after a
/// host barrier) every thread at once declares "my stream depends on the next one" on a shared
/// coordinator and copies the next stream's region with a raw copy that nothing else orders.
/// Every copy must hold the next thread's value; the coordinator counts every dependency.
#[test]
fn coordinator_dependencies_declared_from_eight_threads_order_raw_copies() {
    const THREADS: usize = 8;
    const N: usize = 64 * 1024 + 7;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let legacy = Stream::legacy_default(&context);
    let streams: Vec<Arc<PriorityStream>> = (0..THREADS)
        .map(|_| Arc::new(PriorityStream::new(&context, StreamPriority::Normal).expect("stream")))
        .collect();
    let coordinator = Arc::new(MultiStreamCoordinator::new());
    let sources: Vec<DeviceBuffer<u32>> = (0..THREADS)
        .map(|_| DeviceBuffer::<u32>::zeroed(&context, N).expect("source"))
        .collect();
    let outputs: Vec<DeviceBuffer<u32>> = (0..THREADS)
        .map(|_| DeviceBuffer::<u32>::zeroed(&context, N).expect("output"))
        .collect();
    legacy.synchronize().expect("zeroed");
    let src_ptrs: Arc<Vec<u64>> = Arc::new(sources.iter().map(|b| b.device_ptr()).collect());
    let out_ptrs: Vec<u64> = outputs.iter().map(|b| b.device_ptr()).collect();
    let filled = Arc::new(Barrier::new(THREADS));

    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (kernels, filled, coordinator) =
                (kernels.clone(), filled.clone(), coordinator.clone());
            let own = streams[thread].clone();
            let next = streams[(thread + 1) % THREADS].clone();
            let (src_ptrs, out) = (src_ptrs.clone(), out_ptrs[thread]);
            std::thread::spawn(move || {
                kernels
                    .spin_ns(own.stream(), (5 + thread as u64) * MS)
                    .expect("spin");
                // SAFETY: the source region holds N u32s and outlives the streams' work (the
                // test synchronizes every stream before the buffers drop).
                unsafe { memset_d32_async(src_ptrs[thread], tag(thread, 0), N, own.stream()) }
                    .expect("fill source");
                filled.wait();
                coordinator
                    .add_dependency(&own, &next)
                    .expect("add_dependency");
                // SAFETY: both regions hold N u32s and outlive the copy (see above).
                unsafe {
                    copy_dtod_async(out, src_ptrs[(thread + 1) % THREADS], N * 4, own.stream())
                }
                .expect("copy next region");
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread");
    }
    for stream in &streams {
        stream.synchronize().expect("synchronize");
    }
    for (thread, output) in outputs.iter().enumerate() {
        let expected = tag((thread + 1) % THREADS, 0);
        let bad = output
            .to_vec()
            .expect("read")
            .iter()
            .filter(|&&x| x != expected)
            .count();
        assert_eq!(
            bad, 0,
            "stream {thread} copied {bad} elements before they were written"
        );
    }
    assert_eq!(coordinator.stats().dependencies, THREADS as u64);
    assert_eq!(coordinator.dependencies().len(), THREADS);
    assert!(
        coordinator.has_cycles(),
        "a ring of dependencies is a (diagnostic) cycle"
    );
}

/// Four producer threads allocate from one stream-ordered allocator on their own streams, write
/// behind a spin, and hand the receipt to a consumer thread, which declares the dependency, copies
/// the memory into its own buffer and frees the receipt at once, without waiting. Meanwhile the
/// producer keeps allocating the same size and overwriting it. Every consumer copy must hold the
/// producer's value, and the allocator must end with nothing live.
#[test]
fn stream_ordered_memory_freed_by_a_consumer_thread_is_not_reused_under_its_copy() {
    const PAIRS: usize = 4;
    const ROUNDS: usize = 12;
    const N: usize = 256 * 1024 + 5;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let allocator = Arc::new(StreamOrderedAllocator::new(
        StreamOrderedAllocatorConfig::default(),
    ));
    let mut threads = Vec::new();
    for pair in 0..PAIRS {
        let producer = Arc::new(PriorityStream::new(&context, StreamPriority::Normal).unwrap());
        let consumer = Arc::new(PriorityStream::new(&context, StreamPriority::Normal).unwrap());
        let (tx, rx) = mpsc::channel();
        {
            let (allocator, kernels, producer) =
                (allocator.clone(), kernels.clone(), producer.clone());
            threads.push(std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    let allocation = allocator
                        .allocate_for_stream(&producer, N * 4)
                        .expect("allocate");
                    let ptr = allocator.device_ptr(&allocation).expect("ptr");
                    kernels.spin_ns(producer.stream(), MS).expect("spin");
                    // SAFETY: the allocation holds N u32s, in the producer's order.
                    unsafe { memset_d32_async(ptr, tag(pair, round), N, producer.stream()) }
                        .expect("write");
                    tx.send((allocation, ptr, tag(pair, round)))
                        .expect("consumer alive");
                    // Churn: the same size again, overwritten, freed in our order.
                    let churn = allocator
                        .allocate_for_stream(&producer, N * 4)
                        .expect("churn");
                    let churn_ptr = allocator.device_ptr(&churn).expect("ptr");
                    // SAFETY: as above.
                    unsafe { memset_d32_async(churn_ptr, !0, N, producer.stream()) }
                        .expect("overwrite");
                    allocator.free(churn).expect("free churn");
                }
            }));
        }
        let (allocator, producer) = (allocator.clone(), producer.clone());
        threads.push(std::thread::spawn(move || {
            let out = DeviceBuffer::<u32>::new_on(consumer.stream(), N).expect("out");
            for (allocation, ptr, expected) in rx {
                allocator
                    .add_stream_dependency(&consumer, &producer)
                    .expect("dependency");
                out.prepare_use(consumer.stream()).expect("prepare");
                // SAFETY: the allocation is ordered before the consumer by the dependency, and
                // its free (next line) is ordered after the consumer's work so far.
                unsafe { copy_dtod_async(out.device_ptr(), ptr, N * 4, consumer.stream()) }
                    .expect("copy");
                out.record_use(consumer.stream()).expect("record");
                allocator
                    .free(allocation)
                    .expect("free on the consumer thread");
                let host = out
                    .copy_to_host_async(vec![0u32; N], consumer.stream())
                    .expect("download")
                    .wait()
                    .expect("downloaded");
                let bad = host.iter().filter(|&&x| x != expected).count();
                assert_eq!(bad, 0, "pair {pair}: {bad} elements were overwritten first");
            }
        }));
    }
    for thread in threads {
        thread.join().expect("thread");
    }
    let stats = allocator.stats();
    assert_eq!(allocator.outstanding(), 0);
    assert_eq!(stats.live, 0, "{stats:?}");
    assert_eq!(stats.allocations, stats.frees);
    assert_eq!(stats.allocations, (2 * PAIRS * ROUNDS) as u64);
}

/// One thread captures three increments of a buffer (holding the capture open for a while)
/// while seven threads keep allocating, filling, incrementing, downloading and freeing on their
/// own streams of the same context. The eager work must neither be captured nor break the
/// capture; the graph, replayed five times, must add exactly fifteen.
#[test]
fn a_capture_on_one_thread_survives_eager_work_on_seven_others() {
    const EAGER: usize = 7;
    const N: usize = 1 << 16;
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        "a_capture_on_one_thread_survives_eager_work_on_seven_others",
        "holds a capture open while other streams run",
    ) {
        return;
    }
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let main = PriorityStream::new(&context, StreamPriority::Normal).expect("main");
    let mut x = DeviceBuffer::<u32>::new_on(main.stream(), N).expect("x");
    x.fill_async(100, main.stream()).expect("fill x");
    main.synchronize().expect("sync");
    let x_ptr = x.device_ptr();

    let capturing = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicBool::new(false));
    let during = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(EAGER + 1));
    let eager: Vec<_> = (0..EAGER)
        .map(|thread| {
            let (kernels, capturing, done, during, start) = (
                kernels.clone(),
                capturing.clone(),
                done.clone(),
                during.clone(),
                start.clone(),
            );
            let context = context.clone();
            std::thread::spawn(move || {
                let own = Arc::new(Stream::new(&context, StreamFlags::NON_BLOCKING).unwrap());
                start.wait();
                let mut iteration = 0;
                while !done.load(Ordering::Acquire) || iteration < 4 {
                    let was_capturing = capturing.load(Ordering::Acquire);
                    let len = 1000 + 37 * iteration + thread;
                    let mut buffer = DeviceBuffer::<u32>::new_on(&own, len).expect("eager buffer");
                    let value = tag(thread, iteration);
                    buffer.fill_async(value, &own).expect("eager fill");
                    buffer.prepare_use(&own).expect("prepare");
                    // SAFETY: `buffer` holds len u32s; its use is recorded right after.
                    unsafe { kernels.increment_u32(&own, buffer.device_ptr(), len) }
                        .expect("eager increment");
                    buffer.record_use(&own).expect("record");
                    let host = buffer
                        .copy_to_host_async(vec![0u32; len], &own)
                        .expect("eager download")
                        .wait()
                        .expect("eager downloaded");
                    assert!(
                        host.iter().all(|&v| v == value + 1),
                        "eager thread {thread} iteration {iteration}: wrong bytes"
                    );
                    if was_capturing && capturing.load(Ordering::Acquire) {
                        during.fetch_add(1, Ordering::Relaxed);
                    }
                    iteration += 1;
                }
            })
        })
        .collect();

    start.wait();
    let capture = main
        .begin_capture(CaptureOptions::default())
        .expect("begin capture");
    capturing.store(true, Ordering::Release);
    for _ in 0..3 {
        // SAFETY: x holds N u32s and outlives every replay (synchronized below).
        unsafe { kernels.increment_u32(main.stream(), x_ptr, N) }.expect("captured increment");
        std::thread::sleep(Duration::from_millis(20));
    }
    capturing.store(false, Ordering::Release);
    let graph = capture
        .finish()
        .expect("the capture survived the eager threads");
    let exec = graph
        .instantiate(&InstantiateOptions::default())
        .expect("instantiate");
    for _ in 0..5 {
        main.launch_graph(&exec).expect("replay");
    }
    main.synchronize().expect("replays finished");
    done.store(true, Ordering::Release);
    for thread in eager {
        thread.join().expect("eager thread");
    }
    assert!(
        during.load(Ordering::Relaxed) > 0,
        "some eager work ran while the capture was open"
    );
    let host = x.to_vec().expect("read x");
    let bad = host.iter().filter(|&&v| v != 115).count();
    assert_eq!(
        bad, 0,
        "{bad} elements of x are not 100 + 5 replays x 3 increments"
    );
    assert_eq!(main.metrics().expect("metrics").graph_launches, 5);
}
