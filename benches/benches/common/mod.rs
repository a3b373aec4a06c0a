//! Raw driver calls that more than one bench binary measures against and that the driver crate
//! does not wrap as such. They live here, not in the bench library, because that library
//! forbids `unsafe`.

use cuweave_driver::{Context, driver, sys};
use cuweave_memory::{Buffer, DeviceBuffer};

/// `cuMemcpyHtoD` of `host` into the start of `device`, and nothing else. From pageable memory
/// it returns once the driver has staged the bytes, before they have landed (the driver's own
/// `memory::copy_htod` then waits for the legacy stream).
///
/// # Panics
/// When `host` is longer than `device`, or the driver fails the call (a bench has no use for a
/// failed copy).
pub fn bare_copy_htod(context: &Context, device: &DeviceBuffer<u8>, host: &[u8]) {
    assert!(
        host.len() <= device.len(),
        "the copy fits the device buffer"
    );
    let api = driver().expect("driver");
    context.bind_to_thread().expect("bind the context");
    // SAFETY: `host` is readable for its length and `device` writable for at least that many
    // bytes (checked above); `cuMemcpyHtoD` has finished reading `host` when it returns.
    let code = unsafe {
        (api.memcpy_htod.get().expect("cuMemcpyHtoD"))(
            device.device_ptr(),
            host.as_ptr().cast(),
            host.len(),
        )
    };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS, "cuMemcpyHtoD");
}
