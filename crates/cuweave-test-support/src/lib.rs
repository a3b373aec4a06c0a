//! Test-only helpers for cuweave: find a GPU or skip, and PTX kernels to drive it.
//!
//! GPU tests in every cuweave crate start with [`require_gpu!`]. On a machine without a CUDA
//! driver or device the test prints `SKIPPED <test>: <reason>` to stderr and passes, so
//! `cargo test` stays green everywhere; with `CUWEAVE_REQUIRE_GPU=1` (which `cargo xtask gpu-test`
//! and its bundles set) the same test fails instead, so a GPU run can never pass by skipping.
//!
//! [`kernels::TestKernels`] loads small PTX kernels (fill, add, saxpy, increment, checksum, spin,
//! watch) that let tests check real outcomes: bytes written by the device, ordering observed by a
//! kernel, memory that a running kernel still reads not being reused. [`memory_kernels`] adds a
//! timed reader and a flag-checking writer for cuweave-memory's read/write ordering tests;
//! [`stream_kernels`] a spin that stamps `%globaltimer` and a flag copy for the stream layer.
//!
//! Under compute-sanitizer (`cargo xtask gpu-test --sanitize`, which sets `CUWEAVE_SANITIZE=1`)
//! tests that need two streams to run at once call [`skip_under_sanitizer`].
//!
//! ```no_run
//! use cuweave_driver::{Stream, StreamFlags};
//! use cuweave_test_support::{kernels::TestKernels, require_gpu};
//!
//! # fn main() -> Result<(), cuweave_driver::DriverError> {
//! let gpu = require_gpu!(else return Ok(()));
//! let kernels = TestKernels::load(&gpu.context)?;
//! let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING)?;
//! kernels.spin_ns(&stream, 1_000_000)?;
//! stream.synchronize()?;
//! # Ok(())
//! # }
//! ```

use std::io::Write;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cuweave_driver::{Context, Device, DriverError};

pub mod event_kernels;
pub mod host_flags;
pub mod kernels;
pub mod launch_kernels;
pub mod lcg;
pub mod memory_kernels;
pub mod outside_capture;
pub mod stream_kernels;

/// Name of the environment variable that turns a missing GPU from a skip into a failure.
pub const REQUIRE_GPU_VAR: &str = "CUWEAVE_REQUIRE_GPU";

/// The GPU a test runs on: device 0 and its primary context.
#[derive(Debug, Clone)]
pub struct Gpu {
    /// Device 0.
    pub device: Device,
    /// Device 0's primary context, retained for as long as this value (or a clone) lives.
    pub context: Arc<Context>,
}

/// Device 0 and its primary context, or `None` (after saying why) when the test must be skipped.
///
/// The device is looked up once per process and its primary context stays retained until the
/// process exits, so tests share one context rather than each creating and destroying it; the
/// returned `Arc<Context>` is a fresh handle nobody else holds.
///
/// When no driver or no device is present this writes `SKIPPED <test>: <reason>` straight to the
/// process's stderr (libtest does not capture that, so the skip shows in test output and the
/// `gpu-test` bundle counts it) and returns `None`.
///
/// # Panics
/// When no GPU is usable and `CUWEAVE_REQUIRE_GPU=1`, with the reason: a GPU run must not pass by
/// skipping.
pub fn gpu(test: &str) -> Option<Gpu> {
    // One handle on the primary context is kept for the whole process: releasing the last
    // reference at the end of each test would destroy the context and make the next test pay
    // for creating it again (hundreds of milliseconds). Each caller still gets its own
    // `Arc<Context>` from a fresh retain, so its reference counts are its own.
    static KEPT: OnceLock<Result<Gpu, String>> = OnceLock::new();
    let found = KEPT.get_or_init(find_gpu).as_ref().map_err(String::clone);
    let found = found.and_then(|kept| {
        Context::primary(kept.device)
            .map(|context| Gpu {
                device: kept.device,
                context,
            })
            .map_err(|error| format!("retaining device 0's primary context failed: {error}"))
    });
    match found {
        Ok(gpu) => Some(gpu),
        Err(reason) => {
            if gpu_required() {
                panic!("{test}: {REQUIRE_GPU_VAR}=1 but no GPU is usable: {reason}");
            }
            // One write, so that lines from concurrent tests do not interleave.
            let line = format!("SKIPPED {test}: {reason}\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            None
        }
    }
}

/// Whether `CUWEAVE_REQUIRE_GPU` is `1`, i.e. a test without a GPU must fail instead of skipping.
pub fn gpu_required() -> bool {
    std::env::var_os(REQUIRE_GPU_VAR).is_some_and(|value| value == "1")
}

/// Name of the environment variable the sanitizer run (`cargo xtask gpu-test --sanitize`, a
/// bundle's `run --sanitize`) sets to `1` for every test binary it runs under compute-sanitizer.
pub const SANITIZE_VAR: &str = "CUWEAVE_SANITIZE";

/// Whether the tests run under compute-sanitizer (`CUWEAVE_SANITIZE=1`).
///
/// Memcheck serialises kernels: work on two streams never runs at the same time there, so a
/// test that proves two streams overlap (or holds one stream behind a gate that a kernel on
/// another stream opens) cannot pass under it. Such tests call [`skip_under_sanitizer`].
pub fn sanitizer_active() -> bool {
    std::env::var_os(SANITIZE_VAR).is_some_and(|value| value == "1")
}

/// `true` (after printing `SKIPPED <test>: <why>` to stderr, as a missing GPU does) when the
/// tests run under compute-sanitizer and `test` cannot be judged there: it needs kernels on
/// different streams to run at once, which memcheck's serialisation of kernels makes impossible,
/// or it leaks on purpose what memcheck's leak check would report; `false` otherwise.
///
/// ```no_run
/// #[test]
/// fn readers_overlap() {
///     let gpu = cuweave_test_support::require_gpu!();
///     if cuweave_test_support::skip_under_sanitizer("readers_overlap", "needs two streams at once") {
///         return;
///     }
///     let _ = gpu;
/// }
/// ```
pub fn skip_under_sanitizer(test: &str, why: &str) -> bool {
    if !sanitizer_active() {
        return false;
    }
    skip(test, &format!("under compute-sanitizer: {why}"));
    true
}

/// Prints `SKIPPED <test>: <why>` straight to the process's stderr (libtest does not capture it,
/// and the `gpu-test` bundle counts it as a skip), as a missing GPU does.
pub fn skip(test: &str, why: &str) {
    let line = format!("SKIPPED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Holds a process-wide lock so that timing-sensitive GPU tests of one test binary never overlap.
///
/// libtest runs a binary's tests on parallel threads (the `gpu-test` bundle passes
/// `--test-threads=1`, a plain `cargo test` does not). Tests that need two streams to really run
/// concurrently, or that hold a stream behind a [`kernels::TestKernels::wait_u32`] gate, break
/// when another thread's work shares the GPU: the hardware has few work queues
/// (`CUDA_DEVICE_MAX_CONNECTIONS`, 8 by default), so extra streams alias and serialize, and a
/// driver call that synchronizes the context (`cuMemFree`, `cuMemFreeHost`, module unload) on any
/// thread stalls behind a closed gate. Take the guard first in such tests:
/// `let _serial = cuweave_test_support::serial();`. A test that panicked while holding it does
/// not poison it for the others.
pub fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Device 0 with its primary context, or why there is none (the text a skip prints).
fn find_gpu() -> Result<Gpu, String> {
    let count = Device::count().map_err(|error: DriverError| error.to_string())?;
    if count == 0 {
        return Err("the CUDA driver reports no devices".to_string());
    }
    let device = Device::get(0).map_err(|error: DriverError| error.to_string())?;
    let context = Context::primary(device)
        .map_err(|error| format!("device 0 is present but its primary context failed: {error}"))?;
    Ok(Gpu { device, context })
}

/// The test's name from `std::any::type_name` of a function item declared inside it:
/// `my_crate::tests::fills::__cuweave_test_name` becomes `my_crate::tests::fills`.
#[doc(hidden)]
pub fn __test_name(item_type_name: &'static str) -> &'static str {
    item_type_name
        .strip_suffix("::__cuweave_test_name")
        .unwrap_or(item_type_name)
}

/// Gets the test's [`Gpu`], or skips the test by returning early when there is none.
///
/// `let gpu = require_gpu!();` expands to `match gpu(<this test's path>) { Some(g) => g,
/// None => return }`. In a test that returns a value, say what to return:
/// `let gpu = require_gpu!(else return Ok(()));`. The test's name (its module path and function
/// name) is found automatically; `require_gpu!(name = "custom")` overrides it.
///
/// With `CUWEAVE_REQUIRE_GPU=1` a missing GPU panics instead (see [`gpu`]).
///
/// ```no_run
/// #[test]
/// fn fills_device_memory() {
///     let gpu = cuweave_test_support::require_gpu!();
///     let _ = gpu.device.name();
/// }
/// ```
#[macro_export]
macro_rules! require_gpu {
    (name = $name:expr, else $ret:expr) => {
        match $crate::gpu($name) {
            ::std::option::Option::Some(gpu) => gpu,
            ::std::option::Option::None => {
                #[allow(clippy::needless_return)]
                $ret;
            }
        }
    };
    (name = $name:expr) => {
        $crate::require_gpu!(name = $name, else return)
    };
    (else $ret:expr) => {
        $crate::require_gpu!(
            name = {
                fn __cuweave_test_name() {}
                $crate::__test_name(::std::any::type_name_of_val(&__cuweave_test_name))
            },
            else $ret
        )
    };
    () => {
        $crate::require_gpu!(else return)
    };
}

/// This process's resident memory in bytes (`VmRSS`; 0 where there is no procfs), for tests
/// that check a long loop's memory stays flat.
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status.lines().find_map(|line| {
                line.strip_prefix("VmRSS:")
                    .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            })
        })
        .map_or(0, |kib: u64| kib * 1024)
}

/// Asks `done` until it holds or `limit` has passed (a bounded wait on real progress, never a
/// sleep standing in for it); whether it held. Spins (yielding) for the first millisecond, then
/// naps 100 µs between asks, so a quick answer is seen at once and a long wait costs no core.
pub fn poll_until(limit: std::time::Duration, mut done: impl FnMut() -> bool) -> bool {
    let started = std::time::Instant::now();
    loop {
        if done() {
            return true;
        }
        let waited = started.elapsed();
        if waited >= limit {
            return false;
        }
        if waited < std::time::Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}

/// The threads of this process (`/proc/self/task`; 0 where there is no procfs), for tests that
/// check that what a long loop starts comes back down.
pub fn process_threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, Iterator::count)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn has_device() -> bool {
        Device::count().is_ok_and(|count| count > 0)
    }

    #[test]
    fn gpu_is_some_exactly_when_a_device_is_present() {
        if has_device() {
            assert!(gpu("gpu_is_some_exactly_when_a_device_is_present").is_some());
        } else if gpu_required() {
            let result = std::panic::catch_unwind(|| gpu("required_without_a_device"));
            assert!(result.is_err(), "a required GPU that is missing must panic");
        } else {
            assert!(gpu("skips_without_a_device").is_none());
        }
    }

    #[test]
    fn require_gpu_returns_early_without_a_gpu() {
        if has_device() || gpu_required() {
            return;
        }
        fn body() -> bool {
            let _gpu = require_gpu!(else return false);
            true
        }
        assert!(!body());
        let mut reached = false;
        (|| {
            let _gpu = require_gpu!();
            reached = true;
        })();
        assert!(!reached);
    }

    #[test]
    fn serial_survives_a_panicking_holder() {
        let _ = std::thread::spawn(|| {
            let _serial = serial();
            panic!("a failing GPU test");
        })
        .join();
        drop(serial());
    }

    #[test]
    fn test_name_is_the_enclosing_function_path() {
        fn __cuweave_test_name() {}
        let name = __test_name(std::any::type_name_of_val(&__cuweave_test_name));
        assert_eq!(
            name,
            "cuweave_test_support::tests::test_name_is_the_enclosing_function_path"
        );
        assert_eq!(__test_name("plain"), "plain");
    }
}
