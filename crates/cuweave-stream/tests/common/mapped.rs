//! [`Mapped`]: words of mapped pinned memory that kernels store into and gate on while the host
//! reads and opens them (the test-support crate's `HostFlags`).

#[allow(unused_imports)] // not every test binary uses it
pub use cuweave_test_support::host_flags::HostFlags as Mapped;
