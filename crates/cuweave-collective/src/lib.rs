//! NCCL collectives on cuweave buffers and streams: the library loaded at run time,
//! communicators for one process per GPU or one process driving several, typed collectives that
//! order themselves with the buffers' other uses, deadlines that abort instead of hanging, and
//! collectives run as coordinated operations.
//!
//! # The model
//!
//! cuweave drives NCCL; it does not reimplement it. NCCL is opened at run time (like the CUDA
//! driver, [`loader`]): `$CUWEAVE_NCCL_PATH`, then `libnccl.so.2`, `libnccl.so`, then the
//! `nvidia-nccl-cu13` wheel in any Python site-packages folder found. A machine without NCCL gets
//! [`CollectiveError::NotFound`], never a panic, and everything else in cuweave works.
//!
//! A [`Communicator`] is one rank on one device. Make them with
//! [`Communicator::init_all`] (one process, several GPUs, group semantics) or
//! [`UniqueId::new`] on one rank, the id sent to the others (it serialises), and
//! [`Communicator::init_rank`] on each (one process per GPU, across processes and hosts).
//! Communicators are non-blocking by default: initialisation and every call are polled through
//! `ncclCommGetAsyncError`, so a rank that never arrives becomes a typed
//! [`Timeout`](CollectiveError::Timeout) after [`CommConfig::timeout`], the communicator is
//! aborted, and the process lives on.
//!
//! Collectives take typed cuweave buffers ([`cuweave_memory::Buffer`]) whose element type is an
//! [`NcclType`] (checked at compile time), queue on a stream, and record their reads and writes
//! through the buffers' use trackers, so no buffer is freed or reused under a running
//! collective ([`collective`]). [`Communicator::synchronize`] and
//! [`Communicator::completion`] (a future) wait with the deadline; [`CoordinatedCollectives`]
//! runs them as the event layer's `AllReduce`, `Broadcast` and `Reduction` operations.
//!
//! | item | what it is for |
//! |---|---|
//! | [`loader`], [`nccl`], [`NcclVersion`] | finding and opening NCCL, its version |
//! | [`Communicator`], [`CommConfig`], [`UniqueId`] | ranks: init, split, abort, [`finalize`](Communicator::finalize) (or on drop); NCCL's tuning fields (CTAs, cluster size, net plugin, name, split sharing, traffic class) |
//! | [`collective`], [`Group`], [`ReduceOp`], [`NcclType`] | all-reduce, broadcast, reduce, all-gather, reduce-scatter, send/recv, group calls |
//! | [`F16`], [`Bf16`] | 16-bit float elements (`ncclFloat16`, `ncclBfloat16`) for mixed-precision gradients |
//! | [`CollectiveFuture`] | waiting with a deadline and async-error polling |
//! | [`CoordinatedCollectives`] | collectives as coordinated operations |
//!
//! ```no_run
//! use cuweave_collective::{CommConfig, Communicator, ReduceOp, UniqueId};
//! use cuweave_driver::{Device, Stream, StreamFlags};
//! use cuweave_memory::{Buffer, DeviceBuffer};
//!
//! # fn main() -> cuweave_collective::Result<()> {
//! // One process per GPU: rank 0 makes the id and sends it to the others (file, TCP, MPI...).
//! let id = UniqueId::new()?;
//! let comm = Communicator::init_rank(1, 0, &id, Device::get(0)?, &CommConfig::default())?;
//! let stream = Stream::new(comm.context(), StreamFlags::NON_BLOCKING)?;
//! let mut gradients = DeviceBuffer::<f32>::from_slice(comm.context(), &[1.0; 1 << 20])?;
//! comm.all_reduce_in_place(&mut gradients, ReduceOp::Sum, &stream)?;
//! comm.synchronize(&stream)?;
//! # Ok(())
//! # }
//! ```
#![deny(unsafe_code)]

pub mod collective;
pub mod comm;
mod config;
pub mod coordinated;
pub mod error;
pub mod float16;
mod group_checks;
mod handle;
pub mod id;
#[allow(unsafe_code)]
pub mod loader;
#[allow(unsafe_code)]
mod raw;
mod split;
#[allow(unsafe_code)]
pub mod sys;
pub mod types;
pub mod wait;

pub use collective::Group;
pub use comm::{CommConfig, Communicator};
pub use config::{MAX_CGA_CLUSTER_SIZE, MAX_CTAS};
pub use coordinated::CoordinatedCollectives;
pub use error::{CollectiveError, NcclCode, Result};
pub use float16::{Bf16, F16};
pub use id::UniqueId;
pub use loader::{Nccl, NcclVersion, is_available, nccl};
pub use types::{NcclType, ReduceOp};
pub use wait::CollectiveFuture;
