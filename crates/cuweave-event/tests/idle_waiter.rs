//! An idle waiter parks: its reactor thread uses no measurable CPU. (Needs no GPU; its own
//! binary, so no other test's threads are counted.)

#![cfg(target_os = "linux")]

use std::time::Duration;

use cuweave_event::AsyncEventWaiter;

/// User + system CPU time of this process, in clock ticks (usually 10 ms each).
fn process_cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name (which is in parentheses and may contain spaces).
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 12 and 13 after the name.
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

#[test]
fn an_idle_waiter_uses_no_measurable_cpu() {
    let waiters: Vec<_> = (0..4).map(|_| AsyncEventWaiter::new().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(50));
    let before = process_cpu_ticks();
    std::thread::sleep(Duration::from_millis(500));
    let used = process_cpu_ticks() - before;
    // Four spinning reactors would burn ~200 ticks in 500 ms; parked ones burn none.
    assert!(used <= 2, "idle waiters used {used} ticks of CPU in 500 ms");
    drop(waiters);
}

#[test]
fn one_pending_wait_of_a_second_costs_under_five_percent_of_a_core() {
    // The reactor spins for tens of microseconds, then sleeps until the GPU gets there (its
    // sleeper thread waits on the blocking-sync event behind the completion word). The test
    // thread blocks in `block_on`, so the process's CPU time over the wait is the waiter's.
    let Some(gpu) = cuweave_test_support::gpu("one_pending_wait_of_a_second") else {
        return;
    };
    let kernels = cuweave_test_support::kernels::TestKernels::load(&gpu.context).unwrap();
    let stream =
        cuweave_driver::Stream::new(&gpu.context, cuweave_driver::StreamFlags::NON_BLOCKING)
            .unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    // Warm up: the word slab, the pooled events and the sleeper thread exist before timing.
    kernels.spin_ns(&stream, 5_000_000).unwrap();
    futures::executor::block_on(waiter.stream_idle(&stream).unwrap()).unwrap();
    kernels.spin_ns(&stream, 1_000_000_000).unwrap();
    let started = std::time::Instant::now();
    let before = process_cpu_ticks();
    futures::executor::block_on(waiter.stream_idle(&stream).unwrap()).unwrap();
    let used = process_cpu_ticks() - before;
    let waited = started.elapsed();
    // One tick is 10 ms: 5 % of a core over the wait.
    let budget = (waited.as_millis() as u64 / 10) / 20;
    eprintln!("a {waited:?} wait used {used} ticks of CPU (budget {budget})");
    assert!(
        waited >= Duration::from_millis(900),
        "waited only {waited:?}"
    );
    assert!(
        used <= budget.max(1),
        "a pending {waited:?} wait used {used} ticks of CPU (5 % is {budget})"
    );
}
