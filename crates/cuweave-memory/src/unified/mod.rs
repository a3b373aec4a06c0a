//! Unified (managed) memory hints: [`MemAdvice`], [`MigrationPolicy`], [`ManagedMemoryHints`],
//! [`PrefetchPlan`] and the capability checks behind them.
//!
//! Managed memory ([`UnifiedBuffer`](crate::buffer::UnifiedBuffer)) has one address on the host
//! and every device; the driver migrates its pages to whichever processor touches them, on a
//! page fault. Faults are slow (each stalls the faulting warp or thread while pages move), so a
//! program that knows its access pattern tells the driver ahead of time:
//!
//! - **advice** ([`MemAdvice`]) changes how the driver treats faults: read-mostly ranges get
//!   read-only copies everywhere, a preferred location keeps pages where they are, accessed-by
//!   keeps them mapped into a device so it never faults on them;
//! - a **policy** ([`MigrationPolicy`]) is a named set of advice for a whole range;
//! - a **prefetch** ([`ManagedMemoryHints::prefetch_to`], [`PrefetchPlan`]) migrates pages on a
//!   stream before the kernel that needs them runs, at copy-engine speed instead of fault speed.
//!
//! Prefetches of a buffer are recorded as uses of it, so its host slices wait for them. The
//! device must support managed memory (and, for prefetches and advice aimed at a device,
//! concurrent managed access); otherwise the calls fail with
//! [`DriverError::CapabilityMissing`](cuweave_driver::DriverError::CapabilityMissing) naming
//! what is missing. `docs/unified-memory.md` explains the model and which driver entry points
//! are used on CUDA 12.x and 13.x.
//!
//! ```no_run
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::buffer::UnifiedBuffer;
//! use cuweave_memory::unified::{MemLocation, MigrationPolicy};
//!
//! # fn main() -> cuweave_memory::Result<()> {
//! let context = Context::primary(Device::get(0)?)?;
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! let table = UnifiedBuffer::<u64>::new(&context, 1 << 20)?;
//! table.apply_policy(&MigrationPolicy::PreferDevice(0))?;
//! table.prefetch_to(MemLocation::Device(0), &stream)?;
//! # Ok(())
//! # }
//! ```

mod advice;
mod capability;
mod hints;
mod plan;
mod policy;
mod range;
// Unsafe is allowed here alone in this module: the driver's advise and prefetch calls take raw
// addresses, and raw-range hints rest on their caller's promise about the range's lifetime.
#[allow(unsafe_code)]
mod raw;

pub use advice::MemAdvice;
pub use capability::ManagedCapabilities;
pub use cuweave_driver::memory::MemLocation;
pub use hints::ManagedMemoryHints;
pub use plan::{PrefetchPath, PrefetchPlan};
pub use policy::MigrationPolicy;
pub use range::ManagedRange;
