//! [`AsyncTransfer`]: a pageable upload or download as a `Future`, woken by the event layer.
//!
//! # Why borrowed host memory is safe here
//! The copy engine never touches the caller's memory: it reads and writes pinned blocks that
//! the future owns (inside the memory layer's `PendingCopy`). The caller's slice is read (for
//! uploads) or written (for downloads) only by `poll`, on the polling thread, while the future
//! holds the borrow. So the borrow lasting as long as the future is exactly the guarantee
//! needed: the slice cannot be freed or touched while the transfer is running, and a future
//! that is dropped or `mem::forget`-ed simply stops touching it (its blocks are waited for, or
//! leaked, never freed under the copy engine). This does not compile, because `host` would be
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

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use cuweave_driver::{Event, EventFlags, Stream};
use cuweave_event::WaitFuture;
use cuweave_memory::buffer::PendingCopy;
use cuweave_memory::{Buffer, DeviceBuffer, Element, PinnedPool, TypedPinnedBlock};

use crate::error::{Result, TransferError};
use crate::location::{Location, TransferPath};
use crate::manager::{TransferManager, TransferReport};
use crate::method::TransferMethod;
use crate::planner::{Plan, PlanReason};

/// Which way the bytes go, with the borrowed sides.
enum Direction<'a, T: Element> {
    Upload {
        src: &'a [T],
        dst: &'a mut DeviceBuffer<T>,
        offset: usize,
    },
    Download {
        src: &'a DeviceBuffer<T>,
        offset: usize,
        dst: &'a mut [T],
    },
}

/// A chunk the copy engine is working on: its copy, and an event recorded behind it that the
/// event layer watches.
struct InFlight<T: Element> {
    index: usize,
    copy: PendingCopy<TypedPinnedBlock<T>>,
    done: Arc<Event>,
}

/// A pageable upload or download running in the background, as a `Future` of its
/// [`TransferReport`]; from [`TransferManager::upload_async`] / [`TransferManager::download_async`].
///
/// It does nothing until polled. Each poll copies finished download chunks out of their pinned
/// blocks, refills free blocks with the next upload chunks, queues their copies on the device's
/// stream (up to [`StagingConfig::depth`](crate::StagingConfig::depth) chunks in flight), and
/// registers the task's waker with the event layer's [`WaitFuture`] for the oldest chunk. Works
/// under any executor. Dropping it before it completes waits for the chunks in flight (briefly
/// blocking) and leaves the destination partly written.
#[must_use = "futures do nothing unless polled"]
pub struct AsyncTransfer<'a, T: Element> {
    direction: Direction<'a, T>,
    pool: &'a PinnedPool,
    stream: &'a Stream,
    plan: Plan,
    chunk: usize,
    depth: usize,
    chunks: usize,
    next: usize,
    in_flight: VecDeque<InFlight<T>>,
    spare: Option<TypedPinnedBlock<T>>,
    waiting: Option<(usize, WaitFuture)>,
    started: Option<Instant>,
    finished: bool,
}

impl<T: Element> std::fmt::Debug for AsyncTransfer<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncTransfer")
            .field("path", &self.plan.path)
            .field("chunks", &self.chunks)
            .field("next", &self.next)
            .field("in_flight", &self.in_flight.len())
            .finish_non_exhaustive()
    }
}

impl<T: Element> AsyncTransfer<'_, T> {
    fn len(&self) -> usize {
        match &self.direction {
            Direction::Upload { src, .. } => src.len(),
            Direction::Download { dst, .. } => dst.len(),
        }
    }

    fn range(&self, index: usize) -> std::ops::Range<usize> {
        let start = index * self.chunk;
        start..(start + self.chunk).min(self.len())
    }

    /// Queues chunk `index`: fills a block and uploads it, or downloads into a block.
    fn issue(&mut self, index: usize) -> Result<()> {
        let range = self.range(index);
        let block = match self.spare.take() {
            Some(block) if block.len() == range.len() => block,
            _ => self.pool.get_typed::<T>(range.len())?,
        };
        let copy = match &mut self.direction {
            Direction::Upload { src, dst, offset } => {
                let mut block = block;
                block.as_mut_slice().copy_from_slice(&src[range.clone()]);
                dst.copy_range_from_host_async(*offset + range.start, block, self.stream)?
            }
            Direction::Download { src, offset, .. } => {
                src.copy_range_to_host_async(*offset + range.start, block, self.stream)?
            }
        };
        let done = Arc::new(Event::new(
            self.stream.context(),
            EventFlags::DISABLE_TIMING,
        )?);
        done.record(self.stream)?;
        self.in_flight.push_back(InFlight { index, copy, done });
        Ok(())
    }

    /// Takes back the oldest chunk (its copy has finished) and, for downloads, copies it out.
    fn retire(&mut self) -> Result<()> {
        let Some(front) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let range = self.range(front.index);
        let block = front.copy.wait()?;
        if let Direction::Download { dst, .. } = &mut self.direction {
            dst[range].copy_from_slice(block.as_slice());
        }
        self.spare = Some(block);
        Ok(())
    }

    fn step(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        loop {
            while self.in_flight.len() < self.depth && self.next < self.chunks {
                let index = self.next;
                self.next += 1;
                if let Err(error) = self.issue(index) {
                    return Poll::Ready(Err(error));
                }
            }
            let Some(front) = self.in_flight.front() else {
                return Poll::Ready(Ok(()));
            };
            let index = front.index;
            if !matches!(&self.waiting, Some((i, _)) if *i == index) {
                match cuweave_event::event_done(Arc::clone(&front.done)) {
                    Ok(future) => self.waiting = Some((index, future)),
                    Err(error) => return Poll::Ready(Err(error.into())),
                }
            }
            let (_, future) = self.waiting.as_mut().expect("set just above");
            match Pin::new(future).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                Poll::Ready(Ok(())) => {
                    self.waiting = None;
                    if let Err(error) = self.retire() {
                        return Poll::Ready(Err(error));
                    }
                }
            }
        }
    }
}

// Nothing in the transfer relies on staying at one address: blocks and events live on the heap.
impl<T: Element> Unpin for AsyncTransfer<'_, T> {}

impl<T: Element> Future for AsyncTransfer<'_, T> {
    type Output = Result<TransferReport>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if this.finished {
            return Poll::Ready(Err(TransferError::Unsupported {
                method: TransferMethod::HostStaged,
                path: this.plan.path.to_string(),
                reason: "the transfer was already polled to completion".to_owned(),
            }));
        }
        let started = *this.started.get_or_insert_with(Instant::now);
        match this.step(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(outcome) => {
                this.finished = true;
                Poll::Ready(outcome.map(|()| TransferReport {
                    plan: this.plan.clone(),
                    bytes: this.len() * size_of::<T>(),
                    elapsed: started.elapsed(),
                }))
            }
        }
    }
}

fn staged_plan(src: Location, dst: Location, bytes: usize) -> Plan {
    Plan {
        path: TransferPath::between(src, dst),
        size_class: crate::SizeClass::of(bytes),
        method: TransferMethod::HostStaged,
        reason: PlanReason::OnlyChoice,
        skipped: Vec::new(),
    }
}

impl TransferManager {
    /// Starts uploading `src` into `dst` from element `offset`, as a future (see
    /// [`AsyncTransfer`]): chunks go through pinned blocks on `dst`'s device, one stream,
    /// `StagingConfig::depth` chunks in flight, woken by the event layer. `src` and `dst` stay
    /// borrowed until the future completes or is dropped.
    ///
    /// # Errors
    /// `OutOfRange` when `src` does not fit `dst` from `offset` (before anything is queued).
    pub fn upload_async<'a, T: Element>(
        &'a self,
        src: &'a [T],
        dst: &'a mut DeviceBuffer<T>,
        offset: usize,
    ) -> Result<AsyncTransfer<'a, T>> {
        crate::endpoint::Destination::Device(&mut *dst, offset).check(src.len())?;
        let device = dst.device().ordinal();
        let plan = staged_plan(
            Location::PageableHost,
            Location::Device(device),
            size_of_val(src),
        );
        Ok(self.start_async(
            Direction::Upload { src, dst, offset },
            device,
            plan,
            src.len(),
        ))
    }

    /// Starts downloading `dst.len()` elements of `src` from element `offset` into `dst`, as a
    /// future (see [`AsyncTransfer`]). `dst` is written only while the future is polled, and
    /// holds the data once it resolves.
    ///
    /// # Errors
    /// `OutOfRange` when the range lies outside `src` (before anything is queued).
    pub fn download_async<'a, T: Element>(
        &'a self,
        src: &'a DeviceBuffer<T>,
        offset: usize,
        dst: &'a mut [T],
    ) -> Result<AsyncTransfer<'a, T>> {
        crate::endpoint::Source::device(src, offset, dst.len()).check()?;
        let device = src.device().ordinal();
        let len = dst.len();
        let plan = staged_plan(
            Location::Device(device),
            Location::PageableHost,
            size_of_val(dst),
        );
        Ok(self.start_async(Direction::Download { src, offset, dst }, device, plan, len))
    }

    fn start_async<'a, T: Element>(
        &'a self,
        direction: Direction<'a, T>,
        device: usize,
        plan: Plan,
        len: usize,
    ) -> AsyncTransfer<'a, T> {
        let staging = self.staging();
        let chunk = staging.chunk_elements::<T>();
        let state = self.device(device);
        AsyncTransfer {
            direction,
            pool: &state.pool,
            stream: &state.streams[0],
            plan,
            chunk,
            depth: staging.depth.max(2),
            chunks: len.div_ceil(chunk),
            next: 0,
            in_flight: VecDeque::new(),
            spare: None,
            waiting: None,
            started: None,
            finished: false,
        }
    }
}
