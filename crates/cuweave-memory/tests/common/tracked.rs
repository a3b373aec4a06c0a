//! The tracked `fill_u32` launch shared by the memory crate's probe tests (included with
//! `#[path = "common/tracked.rs"] mod tracked;`): the kernel, and a fill of a `u32` view through
//! `TrackedLaunch` with the view declared written.

use cuweave_driver::{Kernel, LaunchConfig, Stream};
use cuweave_memory::{Buffer, TrackedLaunch};
use cuweave_test_support::kernels::TestKernels;

/// The `fill_u32(unsigned* dst, unsigned value, size_t n)` test kernel.
#[allow(dead_code)] // not every test binary that includes this file asks
pub fn fill_kernel(kernels: &TestKernels) -> Kernel {
    kernels.module().function("fill_u32").expect("fill_u32")
}

/// Fills every element of `view` with `value` by a `fill_u32` kernel (`fill`) on `s`, launched
/// through `TrackedLaunch` with the view declared written; the launch's result is handed back.
pub fn try_tracked_fill<B: Buffer<u32> + ?Sized>(
    fill: &Kernel,
    s: &Stream,
    view: &mut B,
    value: u32,
) -> cuweave_memory::Result<()> {
    let n = view.len() as u64;
    let config = LaunchConfig::for_elements(view.len(), 256).expect("config");
    // SAFETY: fill_u32(unsigned*, unsigned, size_t) gets the view's address, a value and the
    // view's length; it writes only those elements, and the view is declared written.
    unsafe {
        TrackedLaunch::new(fill, s, config)
            .write(view)
            .arg(&value)
            .arg(&n)
            .launch()
    }
}

/// Fills every element of `view` with `value` by the `fill_u32` kernel on `s`, the view declared
/// written; a failed launch panics.
#[allow(dead_code)] // not every test binary that includes this file asks
pub fn tracked_fill<B: Buffer<u32> + ?Sized>(fill: &Kernel, s: &Stream, view: &mut B, value: u32) {
    try_tracked_fill(fill, s, view, value).expect("tracked fill launch");
}
