//! Helpers shared by the transfer crate's GPU tests (each test binary uses some of them).

#![allow(dead_code)]

use std::sync::Arc;

use cuweave_driver::{Context, Kernel, LaunchConfig, Stream, StreamFlags};
use cuweave_memory::{Buffer, DeviceBuffer, TrackedLaunch};
use cuweave_test_support::kernels::TestKernels;
use cuweave_transfer::TransferMethod;

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

/// A non-blocking stream of the user's own, beside the manager's.
pub fn user_stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).unwrap()
}

/// A grid-stride launch over `n` elements of at most `most` blocks of 256 threads.
pub fn grid(n: usize, most: u32) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, most as usize) as u32;
    LaunchConfig {
        grid: (blocks, 1, 1),
        block: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Queues on `stream` a kernel (`watch_u32`) that keeps reading `data` for `ns` nanoseconds,
/// counting into `mismatches` every element it sees differ from `expected`; declared a read of
/// `data` (of its range only, for a view), so a later write of that range on any stream must
/// wait for the kernel.
pub fn watch(
    kernel: &Kernel,
    stream: &Stream,
    data: &impl Buffer<u32>,
    expected: u32,
    ns: u64,
    mismatches: &mut DeviceBuffer<u32>,
) {
    let n = data.len() as u64;
    // SAFETY: watch_u32(const unsigned* data, size_t n, unsigned expected, unsigned long long ns,
    // unsigned* mismatches) gets the buffer's address and length, a value, a duration and a
    // one-word counter; it only reads `data` (declared a read) and atomically adds to the
    // counter (declared a write).
    unsafe {
        TrackedLaunch::new(kernel, stream, grid(data.len(), 120))
            .read(data)
            .arg(&n)
            .arg(&expected)
            .arg(&ns)
            .write(mismatches)
            .launch()
    }
    .unwrap();
}

/// Queues on `stream` a spin of `ns` nanoseconds and then a kernel (`fill_u32`) writing `value`
/// into every element of `data`, declared a write (of its range only, for a view): a later read
/// of that range on any stream must see `value`.
pub fn late_fill(
    kernels: &TestKernels,
    fill: &Kernel,
    stream: &Stream,
    data: &mut impl Buffer<u32>,
    value: u32,
    ns: u64,
) {
    kernels.spin_ns(stream, ns).unwrap();
    let n = data.len() as u64;
    let config = grid(data.len(), 4096);
    // SAFETY: fill_u32(unsigned* dst, unsigned value, size_t n) gets the buffer's address, a
    // value and the buffer's length; it writes only `data`, declared a write.
    unsafe {
        TrackedLaunch::new(fill, stream, config)
            .write(data)
            .arg(&value)
            .arg(&n)
            .launch()
    }
    .unwrap();
}

/// Every public way a pageable host slice reaches a device buffer and comes back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// `transfer`, the planned method.
    Planned,
    /// `transfer_with(HostStaged)`.
    Staged,
    /// `transfer_with(DirectCopy)`.
    Direct,
    /// `upload_async` / `download_async`, awaited.
    Borrowed,
    /// `upload_owned` / `download_owned`, awaited.
    Owned,
    /// `transfer` into and out of `slice_mut` / `slice` views.
    View,
}

impl Way {
    /// Every way, in order.
    pub const ALL: [Self; 6] = [
        Self::Planned,
        Self::Staged,
        Self::Direct,
        Self::Borrowed,
        Self::Owned,
        Self::View,
    ];

    /// The method `transfer_with` is told to use, for the ways that name one.
    pub fn forced(self) -> Option<TransferMethod> {
        match self {
            Self::Staged => Some(TransferMethod::HostStaged),
            Self::Direct => Some(TransferMethod::DirectCopy),
            _ => None,
        }
    }
}

/// `len` `u32` words with no short period, different for each `seed`.
pub fn words(len: usize, seed: u64) -> Vec<u32> {
    bytes(len * 4, seed)
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Byte-exact equality of two element slices, compared with one `memcmp` (the tests also run
/// as debug builds), naming the first differing byte instead of printing megabytes.
pub fn assert_bytes<T: bytemuck::Pod>(got: &[T], want: &[T], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    if g == w {
        return;
    }
    let i = (0..g.len()).find(|&i| g[i] != w[i]).unwrap_or_default();
    panic!(
        "{what}: byte {i} of {} differs (element {} of {} bytes): {:#04x}, expected {:#04x}",
        g.len(),
        i / size_of::<T>().max(1),
        size_of::<T>(),
        g[i],
        w[i]
    );
}

/// Asserts every element of `got` is `value`.
pub fn assert_all_u32(got: &[u32], value: u32, what: &str) {
    if let Some(i) = got.iter().position(|&x| x != value) {
        panic!(
            "{what}: element {i} of {} is {:#x}, expected {value:#x}",
            got.len(),
            got[i]
        );
    }
}
