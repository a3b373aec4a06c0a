//! Transfers for cuweave: a transfer manager that moves bytes between host memory and devices by
//! the fastest real path on this machine.
//!
//! # The model
//!
//! A transfer reads a [`Source`] (pageable host memory as a slice, or a range of a pinned,
//! device or unified buffer, or of host memory registered in place, or a view of a buffer from
//! `slice` / `slice_mut`) and writes a [`Destination`]. The [`TransferManager`] looks at the
//! [`TransferPath`] (which kinds of memory, one device or two) and the [`SizeClass`], and
//! [plans](TransferManager::plan) a [`TransferMethod`]:
//!
//! | method | used for |
//! |---|---|
//! | `DirectCopy` | the plain driver copy: small copies, pinned memory, one device |
//! | `HostStaged` | pageable copies, pipelined through pinned blocks by a persistent pool of staging workers ([`StagingConfig`], per size); device pairs without peer access |
//! | `UnifiedMemory` | managed memory: prefetch to where the copy runs, then copy |
//! | `PeerToPeer` | device pairs with peer access (enabled once per pair) |
//! | `ZeroCopy` | pinned memory addressed through its device mapping, no staging copy |
//!
//! The choice comes from measured bandwidth: [`TransferManager::calibrate`] times each candidate
//! on this machine, per device (per ordered device pair for peer copies) and at each of
//! [`CALIBRATION_SIZES`] (once per process; save the [`CalibrationTable`] as JSON and load it
//! later: a table from other devices is reported), and methods are compared at the measured
//! size nearest the transfer's. Without it the figures of [`CalibrationTable::h100_defaults`]
//! decide, and the [`Plan`] names the machine they came from. A method the devices cannot do
//! (no peer access, no host mapping, no managed prefetch) is skipped for the next one, and the
//! plan says so. Every blocking transfer, every borrowed async one that completes and every
//! owned one that finishes is counted in [`TransferStats`] per path and size class.
//!
//! Devices are opened lazily: a manager makes no context until a transfer needs a device
//! ([`TransferManager::for_devices`] limits it to some). Each transfer holds a lane of streams
//! of its own, so concurrent transfers from different threads overlap instead of queueing on
//! one stream.
//!
//! A host buffer transferred again and again can be page-locked in place once:
//! [`TransferManager::register_host`] returns a [`RegisteredHost`] that borrows the caller's
//! slice, moves at pinned speed with no staging copy, and unregisters when asked
//! ([`RegisteredHost::unregister`]) or on drop. Registering costs milliseconds;
//! [`TransferManager::registration_advice`] says from how many transfers it pays, from the
//! calibrated bandwidths and registration cost ([`RegistrationCost`]).
//!
//! [`TransferManager::upload_async`] and [`TransferManager::download_async`] return an
//! [`AsyncTransfer`] future, woken by the event layer, that keeps the host memory borrowed until
//! it completes and copies at most [`POLL_BYTES`] a poll; [`TransferManager::upload_owned`] and
//! [`TransferManager::download_owned`] take the host `Vec` and the device buffer, run on the
//! staging workers at full speed, and hand both back ([`OwnedTransfer`]).
//!
//! [`TransferBackend`] is the seam for other kinds of device; CUDA ([`CudaBackend`]) and plain
//! host memory ([`HostBackend`]) implement it here.
//!
//! ```no_run
//! use cuweave_driver::{Context, Device};
//! use cuweave_memory::DeviceBuffer;
//! use cuweave_transfer::{Location, TransferManager};
//!
//! # fn main() -> Result<(), cuweave_transfer::TransferError> {
//! let manager = TransferManager::new()?;
//! manager.calibrate()?; // a few hundred ms, once per process
//! println!("{}", manager.plan(Location::PageableHost, Location::Device(0), 512 << 20));
//!
//! let context = Context::primary(Device::get(0)?)?;
//! let data: Vec<f32> = (0..1 << 26).map(|i| i as f32).collect();
//! let mut device = DeviceBuffer::<f32>::new(&context, data.len())?;
//! manager.transfer(&data, &mut device)?;
//! let mut back = vec![0.0f32; data.len()];
//! manager.transfer(&device, &mut back)?;
//! assert_eq!(back, data);
//! # Ok(())
//! # }
//! ```
//!
//! Guide and measured figures: `docs/transfer.md` in the repository.
#![forbid(unsafe_code)]

pub mod advice;
mod async_transfer;
pub mod backend;
mod calibrate;
pub mod calibration;
mod device_state;
pub mod endpoint;
pub mod error;
mod execute;
pub mod location;
pub mod manager;
pub mod method;
pub mod planner;
pub mod registered;
pub mod staging;
pub mod stats;
mod sync;
#[cfg(feature = "timeline")]
pub mod timeline;
mod workers;

pub use advice::{RegistrationAdvice, TransferDirection};
pub use async_transfer::{AsyncTransfer, Owned, OwnedTransfer, POLL_BYTES, POLL_TIME};
pub use backend::{BackendKind, CudaBackend, HostBackend, TransferBackend};
pub use calibrate::{CALIBRATION_SIZES, staging_candidates};
pub use calibration::{
    CalibrationEntry, CalibrationTable, DEFAULT_MACHINE, MachineMismatch, Measure,
    RegistrationCost, StagingChoice,
};
pub use device_state::{MARKED_STREAMS, MAX_IDLE_LANES};
pub use endpoint::{Destination, Source};
pub use error::{Result, TransferError};
pub use location::{Location, LocationKind, SizeClass, TransferPath};
pub use manager::{TransferManager, TransferReport};
pub use method::TransferMethod;
pub use planner::{PathFacts, Plan, PlanReason, Query, Skipped};
pub use registered::{RegisteredHost, RegisteredSlice, RegisteredSliceMut};
pub use staging::{
    ChunkOrder, HostCopy, MAX_CHUNK_BYTES, MAX_DEPTH, MIN_CHUNK_BYTES, ORDERED_FROM, ORDERED_MOST,
    StagingConfig, TWO_STREAMS_FROM, host_threads,
};
pub use stats::{PathStats, TransferStats};
pub use workers::{MAX_WORKERS, WARM, wait_for_cold_workers};
