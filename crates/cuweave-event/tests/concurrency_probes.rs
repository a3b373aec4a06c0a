//! Adversarial multi-threaded probes of the event layer: an operation coordinator driven by
//! producer and consumer threads on their own streams (the chains proven by bytes a consumer
//! copies from its producer's output, every completion callback counted exactly once), thousands
//! of waiter futures and callbacks from eight threads with a third dropped or cancelled in
//! flight, and one cross-stream barrier queued from four threads at once.

mod common;

use common::read_u32s;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::Duration;

use cuweave_driver::memory::{DeviceAllocation, copy_dtod_async, memset_d32_async};
use cuweave_driver::{Context, EventPool, Stream, StreamFlags};
use cuweave_event::{
    AsyncEventWaiter, CrossStreamBarrier, EventPriority, OperationCoordinator, OperationType,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

const US: u64 = 1_000;

fn stream(context: &Arc<Context>) -> Arc<Stream> {
    Arc::new(Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream"))
}

fn tag(thread: usize, round: usize) -> u32 {
    0xE000_0000 | ((thread as u32) << 16) | round as u32
}

/// Waits, at most `limit`, until `waiter` watches nothing.
fn settle(waiter: &AsyncEventWaiter, limit: Duration) {
    assert!(
        cuweave_test_support::poll_until(limit, || waiter.pending() == 0),
        "waiter still pending after {limit:?}"
    );
}

/// Four producer threads and four consumer threads share one coordinator. A producer writes a
/// region behind a spin as an operation on its stream and hands the operation to its consumer,
/// which registers an operation depending on it, begins it on its own stream (the coordinator
/// makes that stream wait) and copies the region with a raw copy nothing else orders. Every
/// region copied must hold its producer's value; every operation's callback runs exactly once.
#[test]
fn coordinator_chains_across_producer_and_consumer_threads_are_proven_by_bytes() {
    const PAIRS: usize = 4;
    const ROUNDS: usize = 24;
    const N: usize = 16 * 1024 + 3;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let coordinator =
        Arc::new(OperationCoordinator::new(EventPool::for_context(&context).unwrap()).unwrap());
    let sources: Vec<DeviceAllocation> = (0..PAIRS * ROUNDS)
        .map(|_| DeviceAllocation::new(&context, N * 4).unwrap())
        .collect();
    let outputs: Vec<DeviceAllocation> = (0..PAIRS * ROUNDS)
        .map(|_| DeviceAllocation::new(&context, N * 4).unwrap())
        .collect();
    let callbacks: Arc<Vec<AtomicU32>> =
        Arc::new((0..2 * PAIRS * ROUNDS).map(|_| AtomicU32::new(0)).collect());
    let mut threads = Vec::new();
    let mut streams = Vec::new();
    for pair in 0..PAIRS {
        let (tx, rx) = mpsc::channel();
        let (producer, consumer) = (stream(&context), stream(&context));
        streams.push(producer.clone());
        streams.push(consumer.clone());
        let src: Vec<u64> = (0..ROUNDS)
            .map(|r| sources[pair * ROUNDS + r].ptr())
            .collect();
        let out: Vec<u64> = (0..ROUNDS)
            .map(|r| outputs[pair * ROUNDS + r].ptr())
            .collect();
        {
            let (coordinator, kernels, callbacks, src) = (
                coordinator.clone(),
                kernels.clone(),
                callbacks.clone(),
                src.clone(),
            );
            threads.push(std::thread::spawn(move || {
                for (round, &region) in src.iter().enumerate() {
                    let id = coordinator
                        .register_operation(
                            OperationType::Kernel,
                            EventPriority::Normal,
                            Some(&producer),
                            &[],
                            format!("produce {pair}/{round}"),
                        )
                        .expect("register producer");
                    coordinator.begin_operation(id, &producer).expect("begin");
                    kernels.spin_ns(&producer, 200 * US).expect("spin");
                    // SAFETY: the region holds N u32s and outlives the test's synchronisation.
                    unsafe { memset_d32_async(region, tag(pair, round), N, &producer) }
                        .expect("produce");
                    coordinator.complete_operation(id).expect("complete");
                    let slot = 2 * (pair * ROUNDS + round);
                    let counts = callbacks.clone();
                    coordinator
                        .on_complete(id, move |_, result| {
                            result.expect("producer completed");
                            counts[slot].fetch_add(1, Ordering::SeqCst);
                        })
                        .expect("on_complete");
                    tx.send(id).expect("consumer alive");
                }
            }));
        }
        let (coordinator, callbacks) = (coordinator.clone(), callbacks.clone());
        threads.push(std::thread::spawn(move || {
            for (round, produced) in rx.into_iter().enumerate() {
                let id = coordinator
                    .register_operation(
                        OperationType::MemoryTransfer,
                        EventPriority::High,
                        Some(&consumer),
                        &[produced],
                        format!("consume {pair}/{round}"),
                    )
                    .expect("register consumer");
                coordinator.begin_operation(id, &consumer).expect("begin");
                // SAFETY: both regions hold N u32s and outlive the test's synchronisation; the
                // begin above ordered the consumer stream after the producer's operation.
                unsafe { copy_dtod_async(out[round], src[round], N * 4, &consumer) }
                    .expect("consume");
                coordinator.complete_operation(id).expect("complete");
                let slot = 2 * (pair * ROUNDS + round) + 1;
                let counts = callbacks.clone();
                coordinator
                    .on_complete(id, move |_, result| {
                        result.expect("consumer completed");
                        counts[slot].fetch_add(1, Ordering::SeqCst);
                    })
                    .expect("on_complete");
            }
        }));
    }
    for thread in threads {
        thread.join().expect("thread");
    }
    for stream in &streams {
        stream.synchronize().expect("synchronize");
    }
    for pair in 0..PAIRS {
        for round in 0..ROUNDS {
            let host = read_u32s(&context, outputs[pair * ROUNDS + round].ptr(), N);
            let bad = host.iter().filter(|&&x| x != tag(pair, round)).count();
            assert_eq!(
                bad, 0,
                "pair {pair} round {round}: copied before it was produced"
            );
        }
    }
    // Callbacks run on the waiter's thread or on the observing call: wait for the last ones.
    cuweave_test_support::poll_until(Duration::from_secs(5), || {
        coordinator.retire_finished();
        callbacks.iter().all(|c| c.load(Ordering::SeqCst) != 0)
    });
    std::thread::sleep(Duration::from_millis(20));
    for (slot, count) in callbacks.iter().enumerate() {
        assert_eq!(
            count.load(Ordering::SeqCst),
            1,
            "callback {slot} ran other than once"
        );
    }
    coordinator.retire_finished();
    assert_eq!(
        coordinator.live_operations(),
        0,
        "every finished operation retired"
    );
}

/// Eight threads each make 500 futures on one private waiter (stream-idle words and pooled
/// events behind short spins) and drop every third in flight, then await the rest on a plain
/// executor; they also register 250 callbacks each and cancel every other one. Every kept
/// future resolves `Ok`, every callback runs or is cancelled (never both, never twice), and the
/// waiter's books balance with nothing pending.
#[test]
fn thousands_of_waits_from_eight_threads_with_a_third_dropped_in_flight() {
    const THREADS: usize = 8;
    const FUTURES: usize = 500;
    const CALLBACKS: usize = 250;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let waiter = Arc::new(AsyncEventWaiter::new().expect("waiter"));
    let pool = EventPool::for_context(&context).unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (waiter, kernels, ran, start, pool) = (
                waiter.clone(),
                kernels.clone(),
                ran.clone(),
                start.clone(),
                pool.clone(),
            );
            let own = stream(&context);
            std::thread::spawn(move || {
                start.wait();
                let mut kept = Vec::new();
                for i in 0..FUTURES {
                    if i % 16 == 0 {
                        kernels.spin_ns(&own, 50 * US).expect("spin");
                    }
                    let future = if (i + thread) % 2 == 0 {
                        waiter.stream_idle(&own).expect("stream_idle")
                    } else {
                        let event = pool.acquire_owned(false).expect("event");
                        event.record(&own).expect("record");
                        waiter.event_done(event)
                    };
                    if i % 3 == 0 {
                        drop(future);
                    } else {
                        kept.push(future);
                    }
                }
                let (mut cancelled, mut ids) = (0usize, Vec::new());
                for i in 0..CALLBACKS {
                    if i % 32 == 0 {
                        kernels.spin_ns(&own, 100 * US).expect("spin");
                    }
                    let event = pool.acquire_owned(false).expect("event");
                    event.record(&own).expect("record");
                    let ran = ran.clone();
                    let id = waiter.wait_async(event, move |result| {
                        result.expect("callback wait");
                        ran.fetch_add(1, Ordering::SeqCst);
                    });
                    ids.push(id);
                }
                for id in ids.iter().step_by(2) {
                    if waiter.cancel_wait(*id) {
                        cancelled += 1;
                    }
                }
                let results = futures::executor::block_on(futures::future::join_all(kept));
                for result in results {
                    result.expect("a kept future resolves Ok");
                }
                own.synchronize().expect("synchronize");
                cancelled
            })
        })
        .collect();
    let cancelled: usize = threads.into_iter().map(|t| t.join().expect("thread")).sum();
    settle(&waiter, Duration::from_secs(5));
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        ran.load(Ordering::SeqCst) + cancelled,
        THREADS * CALLBACKS,
        "every callback ran or was cancelled, exactly once"
    );
    let stats = waiter.stats();
    assert_eq!(stats.failed, 0, "{stats:?}");
    assert_eq!(stats.timed_out, 0, "{stats:?}");
    assert_eq!(stats.pending, 0, "{stats:?}");
    assert_eq!(
        stats.registered,
        stats.completed + stats.cancelled,
        "every wait completed or was cancelled: {stats:?}"
    );
    assert_eq!(stats.registered, (THREADS * (FUTURES + CALLBACKS)) as u64);
}

/// Four threads, each on its own stream of one shared barrier: every round each writes its
/// region behind a spin, all four queue the barrier at once, and each copies the next thread's
/// region with a raw copy only the barrier orders; another concurrent barrier separates the
/// copies from the next round's writes. Every copy holds the round's value.
#[test]
fn one_barrier_queued_from_four_threads_at_once_orders_raw_copies() {
    const THREADS: usize = 4;
    const ROUNDS: usize = 20;
    const N: usize = 32 * 1024 + 1;
    let gpu = require_gpu!();
    let _serial = serial();
    let context = gpu.context.clone();
    let kernels = Arc::new(TestKernels::load(&context).expect("kernels"));
    let streams: Vec<Arc<Stream>> = (0..THREADS).map(|_| stream(&context)).collect();
    let barrier = Arc::new(
        CrossStreamBarrier::new(streams.clone(), EventPool::for_context(&context).unwrap())
            .expect("barrier"),
    );
    let regions: Vec<DeviceAllocation> = (0..THREADS)
        .map(|_| DeviceAllocation::new(&context, N * 4).unwrap())
        .collect();
    let outputs: Vec<DeviceAllocation> = (0..THREADS * ROUNDS)
        .map(|_| DeviceAllocation::new(&context, N * 4).unwrap())
        .collect();
    let region_ptrs: Arc<Vec<u64>> = Arc::new(regions.iter().map(DeviceAllocation::ptr).collect());
    let out_ptrs: Arc<Vec<u64>> = Arc::new(outputs.iter().map(DeviceAllocation::ptr).collect());
    let host = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (barrier, kernels, host, region_ptrs, out_ptrs) = (
                barrier.clone(),
                kernels.clone(),
                host.clone(),
                region_ptrs.clone(),
                out_ptrs.clone(),
            );
            let own = streams[thread].clone();
            std::thread::spawn(move || {
                for round in 0..ROUNDS {
                    host.wait();
                    barrier.queue().expect("barrier before the writes");
                    host.wait();
                    kernels
                        .spin_ns(&own, (100 + 50 * thread as u64) * US)
                        .expect("spin");
                    // SAFETY: the region holds N u32s and outlives the test's synchronisation.
                    unsafe { memset_d32_async(region_ptrs[thread], tag(thread, round), N, &own) }
                        .expect("write");
                    host.wait();
                    barrier.queue().expect("barrier before the copies");
                    host.wait();
                    let next = (thread + 1) % THREADS;
                    // SAFETY: both hold N u32s and outlive the test's synchronisation.
                    unsafe {
                        copy_dtod_async(
                            out_ptrs[thread * ROUNDS + round],
                            region_ptrs[next],
                            N * 4,
                            &own,
                        )
                    }
                    .expect("copy");
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread");
    }
    barrier.synchronize().expect("synchronize");
    for thread in 0..THREADS {
        for round in 0..ROUNDS {
            let expected = tag((thread + 1) % THREADS, round);
            let got = read_u32s(&context, outputs[thread * ROUNDS + round].ptr(), N);
            let bad = got.iter().filter(|&&x| x != expected).count();
            assert_eq!(
                bad, 0,
                "thread {thread} round {round}: {bad} elements unordered"
            );
        }
    }
}
