//! GPU tests of the event pool: real events, growth, counters, 16 threads.

mod common;

use std::sync::Arc;
use std::thread;

use cuweave_event::{EventPool, PoolUtilization};
use cuweave_test_support::require_gpu;

#[test]
fn pooled_events_record_and_return_on_drop() {
    let gpu = require_gpu!();
    let pool = EventPool::new(&gpu.context, 2, 1).unwrap();
    assert_eq!(
        pool.utilization(),
        PoolUtilization {
            available_regular: 2,
            available_timing: 1,
            available_blocking: 0,
            in_use: 0
        }
    );
    let stream = common::stream(&gpu.context);
    let kernels = cuweave_test_support::kernels::TestKernels::load(&gpu.context).unwrap();
    {
        let start = pool.acquire_event(true).unwrap();
        let end = pool.acquire_event(true).unwrap(); // the pool grows: one timing event pre-made
        let done = pool.acquire_event(false).unwrap();
        start.record(&stream).unwrap();
        kernels.spin_ns(&stream, 2 * common::MS).unwrap();
        end.record(&stream).unwrap();
        done.record(&stream).unwrap();
        assert_eq!(pool.utilization().in_use, 3);
        done.synchronize().unwrap();
        let ms = start.elapsed_ms(&end).unwrap();
        assert!(ms >= 1.9, "timing events measured {ms} ms for a 2 ms spin");
        pool.release_event(done);
        assert_eq!(pool.utilization().in_use, 2);
    }
    let counters = pool.counters();
    assert_eq!((counters.created_regular, counters.created_timing), (2, 2));
    assert_eq!(counters.grown, 1);
    assert_eq!(
        pool.utilization(),
        PoolUtilization {
            available_regular: 2,
            available_timing: 2,
            available_blocking: 0,
            in_use: 0
        }
    );
}

#[test]
fn owned_events_time_real_work_outlive_the_pool_value_and_return_to_the_same_lists() {
    let gpu = require_gpu!();
    let pool = EventPool::new(&gpu.context, 1, 2).unwrap();
    let stream = common::stream(&gpu.context);
    let kernels = cuweave_test_support::kernels::TestKernels::load(&gpu.context).unwrap();
    {
        let start = pool.acquire_owned(true).unwrap();
        let end = pool.acquire_owned(true).unwrap();
        // A borrowed handle turned into an owned one is the same event, still counted in use.
        let done = pool.acquire_event(false).unwrap().into_owned();
        assert!(start.is_timing() && !done.is_timing());
        start.record(&stream).unwrap();
        kernels.spin_ns(&stream, 2 * common::MS).unwrap();
        end.record(&stream).unwrap();
        done.record(&stream).unwrap();
        assert_eq!(pool.utilization().in_use, 3);
        done.synchronize().unwrap();
        let ms = start.elapsed_ms(&end).unwrap();
        assert!(
            ms >= 1.9,
            "owned timing events measured {ms} ms for a 2 ms spin"
        );
        // Owned handles keep the pool alive: they may outlive every `EventPool` value.
        let clone = pool.clone();
        let survivors = std::thread::spawn(move || {
            drop(clone);
            (start, end, done)
        })
        .join()
        .unwrap();
        assert!(survivors.0.belongs_to(&pool) && survivors.2.belongs_to(&pool));
        drop(survivors); // returned from this thread, after travelling through another
    }
    assert_eq!(
        pool.utilization(),
        PoolUtilization {
            available_regular: 1,
            available_timing: 2,
            available_blocking: 0,
            in_use: 0
        },
        "each event went back to the list of its kind"
    );
    assert_eq!(pool.counters().grown, 0);
}

#[test]
fn sixteen_threads_lose_no_event_and_create_no_more_than_they_hold() {
    let gpu = require_gpu!();
    const THREADS: usize = 16;
    const HELD: usize = 4;
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            let context = Arc::clone(&gpu.context);
            thread::spawn(move || {
                let stream = common::stream(&context);
                for round in 0..300 {
                    let held: Vec<_> = (0..HELD)
                        .map(|i| pool.acquire_event((t + i + round) % 4 == 0).unwrap())
                        .collect();
                    held[0].record(&stream).unwrap();
                    drop(held);
                }
                stream.synchronize().unwrap();
            })
        })
        .collect();
    for worker in workers {
        worker.join().unwrap();
    }
    let counters = pool.counters();
    let created = counters.created_regular + counters.created_timing;
    assert!(
        created as usize <= THREADS * HELD,
        "created {created} events for {} held",
        THREADS * HELD
    );
    let utilization = pool.utilization();
    assert_eq!(utilization.in_use, 0);
    assert_eq!(
        (utilization.available_regular + utilization.available_timing) as u64,
        created,
        "an event was lost"
    );
    assert_eq!(counters.grown, created);
}

#[test]
fn an_event_released_on_one_thread_is_taken_by_another_before_the_pool_grows() {
    let gpu = require_gpu!();
    let pool = EventPool::new(&gpu.context, 0, 0).unwrap();
    let stream = common::stream(&gpu.context);
    // A worker takes an event, records it, releases it (into its thread's slot) and then
    // idles while this thread asks for one: it must get that event, not a new one.
    let (released_tx, released_rx) = std::sync::mpsc::channel();
    let (finish_tx, finish_rx) = std::sync::mpsc::channel::<()>();
    let worker = {
        let (pool, context) = (pool.clone(), Arc::clone(&gpu.context));
        thread::spawn(move || {
            let stream = common::stream(&context);
            let event = pool.acquire_event(false).unwrap();
            event.record(&stream).unwrap();
            event.synchronize().unwrap();
            drop(event);
            released_tx.send(()).unwrap();
            finish_rx.recv().unwrap();
        })
    };
    released_rx.recv().unwrap();
    assert_eq!(pool.utilization().available_regular, 1);
    let event = pool.acquire_event(false).unwrap();
    event.record(&stream).unwrap();
    event.synchronize().unwrap();
    assert_eq!(
        pool.counters().created_regular,
        1,
        "the pool grew instead of reusing"
    );
    drop(event);
    finish_tx.send(()).unwrap();
    worker.join().unwrap();
    assert_eq!(
        pool.utilization(),
        PoolUtilization {
            available_regular: 1,
            available_timing: 0,
            available_blocking: 0,
            in_use: 0
        }
    );
}
