//! Shared by the GPU tests: NCCL's presence, test patterns and byte-exact comparison.

#![allow(dead_code)]

pub mod increment;

use std::sync::{Arc, OnceLock};

use cuweave_collective::{Bf16, CommConfig, Communicator, F16, NcclType, UniqueId};
use cuweave_driver::{Context, Device, Stream, StreamFlags};

/// A test's first line (`let (gpu, _serial) = gate!();`): the GPU (or a skip), NCCL (or a
/// skip), and the binary's serial guard; returns from the test when either is missing. Used
/// through `#[macro_use] mod common;`.
#[allow(unused_macros)]
macro_rules! gate {
    () => {{
        let gpu = cuweave_test_support::require_gpu!(else return);
        let test = cuweave_test_support::__test_name(std::any::type_name_of_val(&|| ()));
        if !$crate::common::nccl_or_skip(test) {
            return;
        }
        (gpu, cuweave_test_support::serial())
    }};
}

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

impl Pattern for F16 {
    fn at(i: usize, seed: usize) -> Self {
        F16::from_f32(((i * 31 + seed * 7) % 2001) as f32 * 0.5 - 500.0)
    }
}

impl Pattern for Bf16 {
    fn at(i: usize, seed: usize) -> Self {
        Bf16::from_f32(((i * 31 + seed * 7) % 2001) as f32 * 0.25 - 250.0)
    }
}

/// A 1-rank communicator on device 0 shared by the tests of a binary that neither abort nor
/// drop theirs.
pub fn comm() -> &'static Communicator {
    static COMM: OnceLock<Communicator> = OnceLock::new();
    COMM.get_or_init(|| {
        let device = Device::get(0).expect("device 0");
        Communicator::init_rank(
            1,
            0,
            &UniqueId::new().expect("id"),
            device,
            &CommConfig::default(),
        )
        .expect("1-rank init")
    })
}

/// A 1-rank communicator of its own on device 0, for tests that abort, time out, finalize or
/// drop it.
pub fn own_comm(config: &CommConfig) -> Communicator {
    let id = UniqueId::new().expect("id");
    Communicator::init_rank(1, 0, &id, Device::get(0).expect("device 0"), config).expect("init")
}

/// A non-blocking stream of `context`.
pub fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
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
