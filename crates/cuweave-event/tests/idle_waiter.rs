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
