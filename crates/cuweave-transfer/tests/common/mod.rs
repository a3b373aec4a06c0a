//! Helpers shared by the transfer crate's GPU tests.

/// What the tests fill memory with outside the range a transfer writes.
pub const SENTINEL: u8 = 0xEE;

/// `len` bytes with no short period, a different sequence for each `seed`.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
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
