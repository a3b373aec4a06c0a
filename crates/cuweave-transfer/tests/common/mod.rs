//! Helpers shared by the transfer crate's GPU tests (each test binary uses some of them).

#![allow(dead_code)]

/// What the tests fill memory with outside the range a transfer writes.
pub const SENTINEL: u8 = 0xEE;

/// `len` bytes with no short period, a different sequence for each `seed`.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

/// `len` bytes with no short period, different for each `seed` (built a word at a time, so
/// that tens of MiB are quick even in a debug build).
pub fn bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Asserts that `buffer` holds `expected` from `offset` and [`SENTINEL`] everywhere else,
/// naming the first wrong byte instead of printing megabytes.
pub fn assert_range(buffer: &[u8], offset: usize, expected: &[u8], what: &str) {
    let end = offset + expected.len();
    assert!(
        buffer[..offset].iter().all(|&b| b == SENTINEL),
        "{what}: bytes before the range changed"
    );
    assert!(
        buffer[end..].iter().all(|&b| b == SENTINEL),
        "{what}: bytes after the range changed"
    );
    if let Some(first) = (0..expected.len()).find(|&i| buffer[offset + i] != expected[i]) {
        panic!(
            "{what}: first wrong byte at {first} ({:#04x}, expected {:#04x})",
            buffer[offset + first],
            expected[first]
        );
    }
}

/// Wakes the thread that polls.
struct ThreadWaker(std::thread::Thread);

impl std::task::Wake for ThreadWaker {
    fn wake(self: std::sync::Arc<Self>) {
        self.0.unpark();
    }
}

/// Polls `future` to completion on this thread, parking between polls; counts the polls.
pub fn block_on_counted<F: std::future::Future>(future: F) -> (F::Output, usize) {
    let waker = std::task::Waker::from(std::sync::Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    let mut polls = 0;
    loop {
        polls += 1;
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return (output, polls);
        }
        std::thread::park();
    }
}

/// Polls `future` to completion on this thread, parking between polls.
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    block_on_counted(future).0
}
