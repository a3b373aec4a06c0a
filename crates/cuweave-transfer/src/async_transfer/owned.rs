//! [`OwnedTransfer`]: a pageable upload or download that owns its host `Vec` and device buffer,
//! runs on the staging workers at full speed and hands both back ([`Owned`]), and the
//! manager's `upload_owned` / `download_owned` that start one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use cuweave_memory::{Buffer, DeviceBuffer, Element};

use super::handoff::Handoff;
use super::staged_plan;
use crate::device_state::Lane;
use crate::error::{Result, TransferError};
use crate::location::{Location, TransferPath};
use crate::manager::{TransferManager, TransferReport, pipeline};
use crate::planner::Plan;
use crate::stats::TransferStats;
use crate::workers;

/// What an [`OwnedTransfer`] hands back: the host memory and the device buffer it took, and
/// how the transfer went.
#[derive(Debug)]
pub struct Owned<T: Element> {
    /// The host memory (for a download, holding the data when `result` is `Ok`).
    pub host: Vec<T>,
    /// The device buffer (for an upload, holding the data from the offset when `result` is `Ok`).
    pub device: DeviceBuffer<T>,
    /// The report, or what failed.
    pub result: Result<TransferReport>,
}

/// A pageable upload or download that owns its host `Vec` and its device buffer, run by the
/// staging workers at full pipelined speed, as a `Future` of [`Owned`]; from
/// [`TransferManager::upload_owned`] / [`TransferManager::download_owned`].
///
/// It starts at once (not on first poll). A poll only checks whether the workers are done.
/// Dropping it lets the transfer finish in the background and frees both buffers then;
/// forgetting it (`mem::forget`) leaks them, never frees memory a worker still touches.
///
/// # Panics
/// Polled again after it resolved. It has handed both buffers out and has no `Owned` left to
/// give, so it panics, as `Future`'s contract allows, rather than answer `Pending` forever. (A
/// borrowed [`AsyncTransfer`](super::AsyncTransfer), whose output is a `Result`, answers
/// [`TransferError::AlreadyCompleted`] instead.)
#[must_use = "the transfer runs anyway; await it to get the buffers back"]
pub struct OwnedTransfer<T: Element> {
    handoff: Arc<Handoff<Owned<T>>>,
    path: TransferPath,
    finished: bool,
}

impl<T: Element> OwnedTransfer<T> {
    /// A transfer that ended before it started (one of nothing, or one refused): both buffers
    /// and `result` back at the first poll.
    fn finished(
        path: TransferPath,
        host: Vec<T>,
        device: DeviceBuffer<T>,
        result: Result<TransferReport>,
    ) -> Self {
        let handoff = Handoff::new();
        handoff.fill(Owned {
            host,
            device,
            result,
        });
        Self {
            handoff,
            path,
            finished: false,
        }
    }
}

impl<T: Element> std::fmt::Debug for OwnedTransfer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnedTransfer")
            .field("path", &self.path)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<T: Element> Future for OwnedTransfer<T> {
    type Output = Owned<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        assert!(
            !this.finished,
            "OwnedTransfer polled after it completed (it has handed its buffers back)"
        );
        let outcome = this.handoff.poll_take(cx);
        this.finished = outcome.is_ready();
        outcome
    }
}

impl TransferManager {
    /// Starts uploading all of `src` into `dst` from element `offset` on the staging workers,
    /// pipelined like [`transfer`](Self::transfer), and returns a future that hands both
    /// buffers back ([`OwnedTransfer`]). Counted in [`stats`](Self::stats) once it finishes
    /// (whether or not the future is still awaited); an empty one is not counted.
    ///
    /// An empty `src` (with `offset` at most `dst.len()`) returns a transfer that is already
    /// finished, as [`transfer`](Self::transfer) returns at once.
    ///
    /// The buffers always come back, as tokio-uring hands a buffer back with its result: a
    /// transfer refused before it starts resolves at its first poll with both buffers untouched
    /// and the error in [`Owned::result`]. Nothing is counted for it.
    ///
    /// # Errors (in [`Owned::result`])
    /// `OutOfRange` when `src` does not fit `dst` from `offset`; `NoSuchDevice` for a device
    /// the manager does not serve; the driver's error when the device cannot be opened; a
    /// driver error or [`TransferError::WorkerPanicked`] from the copy itself.
    pub fn upload_owned<T: Element>(
        &self,
        src: Vec<T>,
        mut dst: DeviceBuffer<T>,
        offset: usize,
    ) -> OwnedTransfer<T> {
        let device = dst.device().ordinal();
        let bytes = size_of_val(src.as_slice());
        let plan = staged_plan(Location::PageableHost, Location::Device(device), bytes);
        let checked = crate::endpoint::Destination::Device(&mut dst, offset).check(src.len());
        match self.owned_start(checked, device, plan, src.is_empty()) {
            Ok(Start::Run(plan, lane)) => {
                let config = self.staging_for(plan.path, device, bytes);
                let mut lane = lane;
                spawn_owned(plan, src, dst, self.shared_stats(), move |host, device| {
                    pipeline(&mut lane, config, bytes).upload(host, device, offset)
                })
            }
            Ok(Start::Empty(plan)) => {
                OwnedTransfer::finished(plan.path, src, dst, Ok(TransferReport::empty(plan)))
            }
            Err((path, error)) => OwnedTransfer::finished(path, src, dst, Err(error)),
        }
    }

    /// Starts downloading `dst.len()` elements of `src` from element `offset` into `dst` on
    /// the staging workers; the future hands both buffers back ([`OwnedTransfer`]). Counted
    /// in [`stats`](Self::stats) as [`upload_owned`](Self::upload_owned) is.
    ///
    /// # Errors (in [`Owned::result`])
    /// As [`upload_owned`](Self::upload_owned): the buffers come back whatever happened.
    pub fn download_owned<T: Element>(
        &self,
        src: DeviceBuffer<T>,
        offset: usize,
        dst: Vec<T>,
    ) -> OwnedTransfer<T> {
        let device = src.device().ordinal();
        let bytes = size_of_val(dst.as_slice());
        let plan = staged_plan(Location::Device(device), Location::PageableHost, bytes);
        let checked = crate::endpoint::Source::device(&src, offset, dst.len()).check();
        match self.owned_start(checked, device, plan, dst.is_empty()) {
            Ok(Start::Run(plan, lane)) => {
                let config = self.staging_for(plan.path, device, bytes);
                let mut lane = lane;
                spawn_owned(plan, dst, src, self.shared_stats(), move |host, device| {
                    pipeline(&mut lane, config, bytes).download(device, offset, host)
                })
            }
            Ok(Start::Empty(plan)) => {
                OwnedTransfer::finished(plan.path, dst, src, Ok(TransferReport::empty(plan)))
            }
            Err((path, error)) => OwnedTransfer::finished(path, dst, src, Err(error)),
        }
    }

    /// What an owned transfer does once its range is `checked`: run on `device`'s lane, end at
    /// once when it moves nothing (the device only looked up, not opened, as `transfer` does),
    /// or be refused with the error, its path kept for the future's `Debug`.
    fn owned_start(
        &self,
        checked: Result<()>,
        device: usize,
        plan: Plan,
        empty: bool,
    ) -> std::result::Result<Start, (TransferPath, TransferError)> {
        let path = plan.path;
        let started = checked.and_then(|()| {
            if empty {
                self.slot(device).map(|_| Start::Empty(plan))
            } else {
                self.lane(device).map(|lane| Start::Run(plan, lane))
            }
        });
        started.map_err(|error| (path, error))
    }
}

/// How an owned transfer starts ([`TransferManager::owned_start`]).
enum Start {
    /// Copy on this lane.
    Run(Plan, Lane),
    /// Nothing to copy.
    Empty(Plan),
}

/// Runs `job` over `host` and `device` on a staging worker and hands both buffers and its
/// outcome to the returned future. A panic in `job` (a bug) is caught there: the buffers come
/// back with [`TransferError::WorkerPanicked`] instead of the panic aborting the process (the
/// pool's workers have no panic handler) or the future never finishing.
fn spawn_owned<T: Element>(
    plan: Plan,
    mut host: Vec<T>,
    mut device: DeviceBuffer<T>,
    stats: Arc<TransferStats>,
    job: impl FnOnce(&mut [T], &mut DeviceBuffer<T>) -> Result<()> + Send + 'static,
) -> OwnedTransfer<T> {
    let handoff = Handoff::new();
    let back = Arc::clone(&handoff);
    let path = plan.path;
    workers::shared().spawn(move || {
        let start = Instant::now();
        let outcome = workers::caught(|| job(&mut host, &mut device));
        let (bytes, elapsed) = (host.len() * size_of::<T>(), start.elapsed());
        // Counted before the buffers go back, so a caller that awaited the transfer finds it
        // in the statistics, as a borrowed one is once it resolves.
        match &outcome {
            Ok(()) => stats.record_success(plan.path, bytes, elapsed),
            Err(_) => stats.record_failure(plan.path, bytes),
        }
        back.fill(Owned {
            host,
            device,
            result: outcome.map(|()| TransferReport {
                plan,
                bytes,
                elapsed,
            }),
        });
    });
    OwnedTransfer {
        handoff,
        path,
        finished: false,
    }
}
