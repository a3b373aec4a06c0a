//! Shared by the GPU tests: NCCL's presence, test patterns and byte-exact comparison.

#![allow(dead_code)]

use cuweave_collective::NcclType;

/// Whether NCCL loads; prints `SKIPPED <test>: <reason>` when it does not. On a GPU machine run
/// with `CUWEAVE_REQUIRE_GPU=1`, NCCL is part of what is required, so its absence fails.
pub fn nccl_or_skip(test: &str) -> bool {
    match cuweave_collective::nccl() {
        Ok(nccl) => {
            eprintln!("{test}: NCCL {} from {}", nccl.version(), nccl.path());
            true
        }
        Err(error) => {
            assert!(
                !cuweave_test_support::gpu_required(),
                "{test}: CUWEAVE_REQUIRE_GPU=1 but NCCL is missing: {error}"
            );
            skip(test, &error.to_string());
            false
        }
    }
}

/// Writes `SKIPPED <test>: <why>` straight to the process's stderr, as the GPU gate does
/// (libtest does not capture it, so the skip shows and the bundle's `run` counts it).
pub fn skip(test: &str, why: &str) {
    use std::io::Write as _;
    let line = format!("SKIPPED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Values that survive every reduction of one rank unchanged and are never NaN.
pub trait Pattern: NcclType + PartialEq + std::fmt::Debug {
    fn at(i: usize, seed: usize) -> Self;
}

macro_rules! int_pattern {
    ($($t:ty),*) => {$(
        impl Pattern for $t {
            fn at(i: usize, seed: usize) -> Self {
                (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) % 251) as $t
            }
        }
    )*};
}
int_pattern!(i8, u8, i32, u32, i64, u64);

impl Pattern for f32 {
    fn at(i: usize, seed: usize) -> Self {
        ((i * 31 + seed * 7) % 4093) as f32 * 0.25 - 500.0
    }
}

impl Pattern for f64 {
    fn at(i: usize, seed: usize) -> Self {
        ((i * 31 + seed * 7) % 65_521) as f64 * 0.125 - 4000.0
    }
}

pub fn pattern<T: Pattern>(len: usize, seed: usize) -> Vec<T> {
    (0..len).map(|i| T::at(i, seed)).collect()
}

/// Byte-exact equality, reporting the first difference.
pub fn assert_bytes_eq<T: NcclType + std::fmt::Debug>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let (g, w): (&[u8], &[u8]) = (bytemuck::cast_slice(got), bytemuck::cast_slice(want));
    if g != w {
        let first = g.iter().zip(w).position(|(a, b)| a != b).unwrap_or(0);
        let element = first / size_of::<T>();
        panic!(
            "{what}: byte {first} differs (element {element}: got {:?}, want {:?})",
            got[element], want[element]
        );
    }
}
