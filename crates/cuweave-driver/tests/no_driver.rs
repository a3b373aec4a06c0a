//! What a machine without a usable CUDA driver sees, and how driver errors read.
//!
//! These tests need no GPU: they run everywhere, CI included. The no-driver test can only observe
//! its subject where the driver really is missing; where one is loaded it says so and checks the
//! opposite instead.

use cuweave_driver::loader::LIBRARY_CANDIDATES;
use cuweave_driver::{Device, DriverError, driver, driver_version, is_available, sys};
use rstest::rstest;

#[test]
fn every_entry_point_reports_the_missing_driver() {
    let error = match driver() {
        Ok(_) => {
            eprintln!(
                "a CUDA driver is loaded here, so the no-driver paths cannot be observed; \
                 checking that the entry points agree it is available instead"
            );
            assert!(is_available());
            assert!(Device::count().is_ok());
            assert!(driver_version().is_ok());
            return;
        }
        Err(error) => error,
    };
    if let DriverError::NotFound { searched, reason } = &error {
        for candidate in LIBRARY_CANDIDATES {
            assert!(
                searched.contains(candidate),
                "`{searched}` does not name {candidate}"
            );
        }
        assert!(!reason.is_empty(), "NotFound without the loader's reason");
    } else {
        // A driver that loads but cannot initialise (no device, say) is cached the same way.
        eprintln!("the driver loaded but failed to initialise: {error}");
    }
    assert!(!is_available());
    // The outcome is cached: every entry point, asked twice, returns the very same error.
    for _ in 0..2 {
        assert_eq!(driver().err(), Some(error.clone()));
        assert_eq!(Device::count(), Err(error.clone()));
        assert_eq!(Device::get(0), Err(error.clone()));
        assert_eq!(Device::from_raw(0), Err(error.clone()));
        assert_eq!(Device::all(), Err(error.clone()));
        assert_eq!(driver_version(), Err(error.clone()));
    }
}

#[test]
fn a_missing_driver_is_not_found_and_nothing_else() {
    let Err(error) = driver() else {
        eprintln!("a CUDA driver is loaded here; NotFound cannot be observed");
        assert!(is_available());
        return;
    };
    if error.is_not_found() {
        assert_eq!(error.code(), None);
        assert!(!error.is_out_of_memory());
        assert!(!error.is_not_ready());
    } else {
        assert!(
            matches!(
                error,
                DriverError::Cuda {
                    operation: "cuInit",
                    ..
                }
            ),
            "a loaded driver can only fail in cuInit, got {error:?}"
        );
    }
}

fn cuda(code: u32, operation: &'static str) -> DriverError {
    DriverError::Cuda { code, operation }
}

#[test]
fn names_and_descriptions_come_from_the_driver_when_asked() {
    let error = cuda(2, "cuMemAlloc_v2");
    assert_eq!(error.operation(), Some("cuMemAlloc_v2"));
    let (name, description) = (error.name().unwrap(), error.description().unwrap());
    if driver().is_ok() {
        assert_eq!(name, "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(description, "out of memory");
        assert!(
            error
                .to_string()
                .contains("CUDA_ERROR_OUT_OF_MEMORY (2): out of memory")
        );
    } else {
        assert_eq!(name, "CUresult 2");
        assert_eq!(description, "unknown error");
    }
    let unsupported = DriverError::Unsupported { symbol: "cuX" };
    assert_eq!(unsupported.name(), None);
    assert_eq!(unsupported.description(), None);
    assert_eq!(unsupported.operation(), None);
}

#[rstest]
#[case::cuda(
    cuda(2, "cuMemAlloc_v2"),
    &["cuMemAlloc_v2 failed", "(2)"],
)]
#[case::not_found(
    DriverError::NotFound {
        searched: "libcuda.so.1, libcuda.so".to_owned(),
        reason: "cannot open shared object file".to_owned(),
    },
    &["libcuda.so.1", "libcuda.so", "cannot open shared object file"],
)]
#[case::unsupported(
    DriverError::Unsupported { symbol: "cuMemPrefetchBatchAsync" },
    &["cuMemPrefetchBatchAsync"],
)]
#[case::capability(
    DriverError::CapabilityMissing {
        capability: "concurrent managed access",
        device: 3,
        operation: "prefetch_async",
    },
    &["concurrent managed access", "device 3", "prefetch_async"],
)]
#[case::invalid(
    DriverError::InvalidArgument {
        operation: "DeviceAllocation::new",
        reason: "zero-byte request".to_owned(),
    },
    &["DeviceAllocation::new", "zero-byte request"],
)]
fn display_names_what_failed_and_why(#[case] error: DriverError, #[case] expected: &[&str]) {
    let text = error.to_string();
    for part in expected {
        assert!(text.contains(part), "{text:?} lacks {part:?}");
    }
}

#[rstest]
#[case::out_of_memory(
    cuda(2, "cuMemAlloc_v2"),
    Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY),
    true,
    false
)]
#[case::not_ready(
    cuda(600, "cuStreamQuery"),
    Some(sys::CUresult::CUDA_ERROR_NOT_READY),
    false,
    true
)]
#[case::other_cuda(
    cuda(500, "cuModuleGetFunction"),
    Some(sys::CUresult::CUDA_ERROR_NOT_FOUND),
    false,
    false
)]
#[case::not_a_driver_code(
    DriverError::Unsupported { symbol: "cuMemAdvise_v2" },
    None,
    false,
    false
)]
fn predicates_read_the_driver_code(
    #[case] error: DriverError,
    #[case] code: Option<sys::CUresult>,
    #[case] out_of_memory: bool,
    #[case] not_ready: bool,
) {
    assert_eq!(error.code(), code);
    assert_eq!(error.is_out_of_memory(), out_of_memory);
    assert_eq!(error.is_not_ready(), not_ready);
    assert!(!error.is_not_found());
}
