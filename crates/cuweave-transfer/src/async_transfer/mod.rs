//! Async transfers: [`AsyncTransfer`], a pageable upload or download of *borrowed* host memory
//! as a `Future` whose polls do bounded work, and [`OwnedTransfer`], one that takes the host
//! `Vec` and the device buffer, runs on the staging workers at full speed, and hands both back.
//!
//! # Neither blocks the executor
//! A poll of an [`AsyncTransfer`] copies at most [`POLL_BYTES`] of host memory, and works at
//! most about [`POLL_TIME`], or makes one driver call (queueing a chunk's copy or the mark
//! behind it, or taking a landed chunk back) and nothing else, then (if there is more to do)
//! wakes its own task and returns `Pending`, so an executor thread is never held for long; its
//! pinned blocks are taken from the pool by a staging worker, never pinned on the polling
//! thread. A poll of an [`OwnedTransfer`] only looks at a completion slot.
//!
//! # Why borrowed host memory is safe here
//! The copy engine never touches the caller's memory: it reads and writes pinned blocks that
//! the future owns (inside the memory layer's `PendingCopy`). The caller's slice is read (for
//! uploads) or written (for downloads) only by `poll`, on the polling thread, while the future
//! holds the borrow. So the borrow lasting as long as the future is exactly the guarantee
//! needed: the slice cannot be freed or touched while the transfer is running, and a future
//! that is dropped or `mem::forget`-ed simply stops touching it (its blocks are waited for, or
//! leaked, never freed under the copy engine). No background thread ever sees the caller's
//! slice: that is why this form copies in its polls (a bounded amount each), and why the fast
//! background form, [`OwnedTransfer`], owns its host memory instead of borrowing it (the
//! `io_uring` rule: memory a background agent may still touch must be owned by the operation,
//! since a forgotten future runs no destructor). This does not compile, because `host` would be
//! freed while the transfer still borrows it:
//!
//! ```compile_fail
//! use cuweave_memory::DeviceBuffer;
//! use cuweave_transfer::TransferManager;
//!
//! fn start<'a>(
//!     manager: &'a TransferManager,
//!     device: &'a mut DeviceBuffer<u8>,
//! ) -> cuweave_transfer::AsyncTransfer<'a, u8> {
//!     let host = vec![1u8; 1 << 20];
//!     manager.upload_async(&host, device, 0).unwrap() // error: `host` does not live long enough
//! }
//! ```
//!
//! The same with the host memory outliving the transfer compiles:
//!
//! ```no_run
//! use cuweave_driver::{Context, Device};
//! use cuweave_memory::DeviceBuffer;
//! use cuweave_transfer::TransferManager;
//!
//! async fn upload(manager: &TransferManager, device: &mut DeviceBuffer<u8>) -> cuweave_transfer::Result<()> {
//!     let host = vec![1u8; 1 << 20];
//!     let report = manager.upload_async(&host, device, 0)?.await?;
//!     println!("{:.1} GB/s", report.gbps());
//!     Ok(())
//! }
//! ```

use crate::location::{Location, TransferPath};
use crate::method::TransferMethod;
use crate::planner::{Plan, PlanReason};

mod borrowed;
mod handoff;
mod owned;

pub use borrowed::AsyncTransfer;
pub use owned::{Owned, OwnedTransfer};

/// The most host bytes one poll of an [`AsyncTransfer`] copies (about 4 µs of streaming copy on
/// one core of the H100 host) before it yields to the executor. A poll's longest is its work
/// plus whatever the host's scheduler takes from it mid-poll (30-50 µs on a calm lease of that
/// host), so the work is kept to a few microseconds.
pub const POLL_BYTES: usize = 32 << 10;

/// The most time one poll of an [`AsyncTransfer`] spends copying host bytes before it yields,
/// whatever its byte budget. Driver calls (several microseconds each, tens on a busy host) get
/// polls of their own: one per poll, in a poll that copies nothing.
pub const POLL_TIME: std::time::Duration = std::time::Duration::from_micros(12);

fn staged_plan(src: Location, dst: Location, bytes: usize) -> Plan {
    Plan {
        path: TransferPath::between(src, dst),
        size_class: crate::SizeClass::of(bytes),
        method: TransferMethod::HostStaged,
        reason: PlanReason::OnlyChoice,
        skipped: Vec::new(),
        measured_on: None,
    }
}
