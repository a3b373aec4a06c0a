//! cuweave facade (in progress).
#![forbid(unsafe_code)]
#[cfg(feature = "driver")]
pub use cuweave_driver as driver;
#[cfg(feature = "memory")]
pub use cuweave_memory as memory;
