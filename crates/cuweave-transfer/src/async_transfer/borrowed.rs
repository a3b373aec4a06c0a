//! [`AsyncTransfer`]: a pageable upload or download of borrowed host memory as a `Future`
//! whose polls copy a bounded amount each, and the manager's `upload_async` /
//! `download_async` that start one.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use cuweave_driver::{EventPool, OwnedPooledEvent};
use cuweave_event::WaitFuture;
use cuweave_memory::buffer::PendingCopy;
use cuweave_memory::{Buffer, DeviceBuffer, Element, TypedPinnedBlock, copy_streaming};

use super::handoff::Handoff;
use super::{POLL_BYTES, POLL_TIME, staged_plan};
use crate::device_state::Lane;
use crate::error::{Result, TransferError};
use crate::location::{Location, TransferPath};
use crate::manager::{TransferManager, TransferReport};
use crate::planner::Plan;
use crate::stats::TransferStats;
use crate::workers;

/// The chunk an [`AsyncTransfer`] moves per copy: large enough that queueing a copy is cheap
/// beside moving it, small enough that a few in flight cost little pinned memory.
const ASYNC_CHUNK_BYTES: usize = 1 << 20;

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
    /// `None` from the poll that queued the copy until the next poll queues the mark.
    landed: Option<Landed>,
}

/// How a poll learns that an in-flight chunk has landed.
enum Landed {
    /// A completion word written behind the chunk (the default): the waiter's reactor watches
    /// it with plain loads, so no driver call of the reactor contends with a poll's.
    Word(WaitFuture),
    /// An event recorded behind the chunk, polled by the reactor with `cuEventQuery`: where the
    /// stream cannot write a completion word.
    Event(Arc<OwnedPooledEvent>),
}

/// A chunk whose host side is being copied over several polls: `done` elements so far.
struct Partial<T: Element> {
    index: usize,
    block: TypedPinnedBlock<T>,
    done: usize,
}

/// The pinned blocks of one transfer: full chunks, and one for a short last chunk. Full blocks
/// are reused oldest first: a download's block just copied out is the slowest for the copy
/// engine to write again (`PinnedPool::get_cold`).
struct Blocks<T: Element> {
    full: VecDeque<TypedPinnedBlock<T>>,
    tail: Option<TypedPinnedBlock<T>>,
}

/// A pageable upload or download of borrowed host memory running in the background, as a
/// `Future` of its [`TransferReport`]; from [`TransferManager::upload_async`] /
/// [`TransferManager::download_async`].
///
/// It does nothing until polled. Its first poll asks a staging worker for its pinned blocks;
/// then each poll copies at most [`POLL_BYTES`] between the caller's memory and a block, queues
/// finished upload chunks (or download copies into free blocks) on its own lane's stream, up to
/// [`StagingConfig::depth`](crate::StagingConfig::depth) chunks in flight, each with a
/// completion word behind it (the event layer's [`stream_idle`](cuweave_event::stream_idle);
/// an event where the stream cannot write one), and waits on the oldest chunk's
/// [`WaitFuture`]. A poll that queues a copy or a word, or takes a landed chunk back, does
/// nothing else. It moves about as fast as one core copies; [`OwnedTransfer`] uses every
/// staging worker. Works under any executor. Dropping it before it completes waits for the
/// chunks in flight (briefly blocking) and leaves the destination partly written.
///
/// A transfer that completes is counted in the manager's [`stats`](TransferManager::stats) as a
/// blocking one is (a failed one as a failure; one dropped before it completes not at all).
/// Polled again after it completed, it answers [`TransferError::AlreadyCompleted`] and copies
/// nothing.
///
/// [`OwnedTransfer`]: crate::OwnedTransfer
#[must_use = "futures do nothing unless polled"]
pub struct AsyncTransfer<'a, T: Element> {
    direction: Direction<'a, T>,
    lane: Lane,
    plan: Plan,
    chunk: usize,
    depth: usize,
    chunks: usize,
    next: usize,
    in_flight: VecDeque<InFlight<T>>,
    partial: Option<Partial<T>>,
    /// An upload chunk whose block is filled, to be queued by the next poll with time for it.
    filled: Option<(usize, TypedPinnedBlock<T>)>,
    blocks: Option<Blocks<T>>,
    requested: Option<Arc<Handoff<Result<Blocks<T>>>>>,
    /// Where chunks land behind [`Landed::Event`]s: the reactor's registration of the oldest.
    waiting: Option<(usize, WaitFuture)>,
    /// Whether chunks still get completion words ([`Landed::Word`]).
    words: bool,
    /// The lane's context's event pool, fetched once here, not per chunk in a poll.
    events: EventPool,
    started: Option<Instant>,
    finished: bool,
    /// The manager's statistics, where the outcome is counted once the transfer completes.
    stats: &'a TransferStats,
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

    /// Asks a staging worker for this transfer's blocks (pinning, if the pool has none, takes
    /// milliseconds: never on the polling thread).
    fn request_blocks(&mut self) -> Arc<Handoff<Result<Blocks<T>>>> {
        let handoff = Handoff::new();
        let pool = self.lane.state.pool.clone();
        let (chunk, depth, len) = (self.chunk, self.depth, self.len());
        let full = depth.min(len / chunk);
        let tail = len % chunk;
        let back = Arc::clone(&handoff);
        let download = matches!(self.direction, Direction::Download { .. });
        workers::shared().spawn(move || {
            // Downloads land in the pool's coldest blocks, uploads fill its warmest.
            let get = |len| {
                if download {
                    pool.get_typed_cold::<T>(len)
                } else {
                    pool.get_typed::<T>(len)
                }
            };
            back.fill(workers::caught(|| {
                Ok(Blocks {
                    full: (0..full)
                        .map(|_| get(chunk))
                        .collect::<cuweave_memory::Result<_>>()?,
                    tail: (tail > 0).then(|| get(tail)).transpose()?,
                })
            }));
        });
        handoff
    }

    /// A free block for chunk `index`, if one is back from the copy engine.
    fn free_block(&mut self, index: usize) -> Option<TypedPinnedBlock<T>> {
        let full = self.range(index).len() == self.chunk;
        let blocks = self.blocks.as_mut()?;
        if full {
            blocks.full.pop_front()
        } else {
            blocks.tail.take()
        }
    }

    fn give_back(&mut self, block: TypedPinnedBlock<T>) {
        if let Some(blocks) = self.blocks.as_mut() {
            if block.len() == self.chunk {
                blocks.full.push_back(block);
            } else {
                blocks.tail = Some(block);
            }
        }
    }

    /// Queues chunk `index`'s copy (an upload's block is filled already); the chunk is watched
    /// from the next poll on, which queues its [`Landed`] mark
    /// ([`mark_newest`](Self::mark_newest)).
    fn queue_copy(&mut self, index: usize, block: TypedPinnedBlock<T>) -> Result<()> {
        let start = self.range(index).start;
        let stream = self.lane.stream();
        let copy = match &mut self.direction {
            Direction::Upload { dst, offset, .. } => {
                dst.copy_range_from_host_async(*offset + start, block, stream)?
            }
            Direction::Download { src, offset, .. } => {
                src.copy_range_to_host_async(*offset + start, block, stream)?
            }
        };
        self.in_flight.push_back(InFlight {
            index,
            copy,
            landed: None,
        });
        Ok(())
    }

    /// Whether the newest chunk queued still needs its [`Landed`] mark.
    fn newest_unmarked(&self) -> bool {
        self.in_flight
            .back()
            .is_some_and(|chunk| chunk.landed.is_none())
    }

    /// Queues the mark the newest chunk is watched by: a completion word behind it on the
    /// lane's stream (an event where the stream cannot write one). Queued after the copy, on
    /// the same stream, so it passes only once the copy has landed.
    fn mark_newest(&mut self) -> Result<()> {
        let stream = self.lane.stream();
        let landed = match self.words.then(|| cuweave_event::stream_idle(stream)) {
            Some(Ok(word)) => Landed::Word(word),
            outcome => {
                if let Some(Err(error)) = outcome {
                    // Not retried per chunk: this transfer watches events from here on.
                    tracing::debug!(%error, "no completion word behind an async chunk; using events");
                    self.words = false;
                }
                // From the context's event pool (the one every layer shares).
                let done = Arc::new(self.events.acquire_owned(false)?);
                done.record(stream)?;
                Landed::Event(done)
            }
        };
        if let Some(chunk) = self.in_flight.back_mut() {
            chunk.landed = Some(landed);
        }
        Ok(())
    }

    /// Whether a block is free for chunk `index`.
    fn has_free_block(&self, index: usize) -> bool {
        let full = self.range(index).len() == self.chunk;
        self.blocks.as_ref().is_some_and(|blocks| {
            if full {
                !blocks.full.is_empty()
            } else {
                blocks.tail.is_some()
            }
        })
    }

    /// Copies up to `*budget` elements of the partial chunk's host side; `true` once it is
    /// complete (then it waits in `filled` to be queued, for uploads, or its block is freed,
    /// for downloads).
    fn advance_partial(&mut self, budget: &mut usize) -> Result<bool> {
        let Some(mut partial) = self.partial.take() else {
            return Ok(true);
        };
        let range = self.range(partial.index);
        let n = (*budget).min(range.len() - partial.done);
        let (from, to) = (partial.done, partial.done + n);
        match &mut self.direction {
            Direction::Upload { src, .. } => copy_streaming(
                &mut partial.block.as_mut_slice()[from..to],
                &src[range.start + from..range.start + to],
            )?,
            Direction::Download { dst, .. } => copy_streaming(
                &mut dst[range.start + from..range.start + to],
                &partial.block.as_slice()[from..to],
            )?,
        }
        *budget -= n;
        partial.done = to;
        if partial.done < range.len() {
            self.partial = Some(partial);
            return Ok(false);
        }
        match self.direction {
            Direction::Upload { .. } => self.filled = Some((partial.index, partial.block)),
            Direction::Download { .. } => self.give_back(partial.block),
        }
        Ok(true)
    }

    fn step(&mut self, cx: &mut Context<'_>) -> Poll<Result<()>> {
        if self.blocks.is_none() && self.chunks > 0 {
            let handoff = match &self.requested {
                Some(handoff) => Arc::clone(handoff),
                None => {
                    let handoff = self.request_blocks();
                    self.requested = Some(Arc::clone(&handoff));
                    handoff
                }
            };
            match handoff.poll_take(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error)),
                Poll::Ready(Ok(blocks)) => {
                    self.blocks = Some(blocks);
                    self.requested = None;
                }
            }
        }
        let full_budget = (POLL_BYTES / size_of::<T>().max(1)).max(1);
        let mut budget = full_budget;
        let started = Instant::now();
        // Comes back for the rest in the next poll.
        let again = |cx: &mut Context<'_>| {
            cx.waker().wake_by_ref();
            Poll::Pending
        };
        // A poll makes at most one of its driver calls (queueing a chunk's copy, queueing its
        // mark, taking a landed chunk back), and only if it has not copied host bytes: each
        // can take tens of microseconds on a busy host, so a poll doing two, or one after its
        // copy budget, is what ran past the poll target.
        loop {
            let worked = budget < full_budget;
            if started.elapsed() >= POLL_TIME {
                return again(cx);
            }
            if self.newest_unmarked() {
                if worked {
                    return again(cx);
                }
                if let Err(error) = self.mark_newest() {
                    return Poll::Ready(Err(error));
                }
                return again(cx);
            }
            if let Some((index, block)) = self.filled.take() {
                if worked {
                    self.filled = Some((index, block));
                    return again(cx);
                }
                if let Err(error) = self.queue_copy(index, block) {
                    return Poll::Ready(Err(error));
                }
                return again(cx);
            }
            match self.advance_partial(&mut budget) {
                Err(error) => return Poll::Ready(Err(error)),
                // Out of budget: let the executor run others, and come back.
                Ok(false) => return again(cx),
                // A filled upload chunk is queued by the next poll.
                Ok(true) if self.filled.is_some() => return again(cx),
                Ok(true) => {}
            }
            let worked = budget < full_budget;
            if budget == 0 {
                return again(cx);
            }
            // Start the next chunk where a block is free.
            let index = self.next;
            if index < self.chunks
                && self.in_flight.len() < self.depth
                && self.has_free_block(index)
            {
                let download = matches!(self.direction, Direction::Download { .. });
                if download && worked {
                    // A download starts its chunk by queueing its copy: next poll.
                    return again(cx);
                }
                let block = self.free_block(index).expect("checked just above");
                self.next += 1;
                if !download {
                    self.partial = Some(Partial {
                        index,
                        block,
                        done: 0,
                    });
                    continue;
                }
                if let Err(error) = self.queue_copy(index, block) {
                    return Poll::Ready(Err(error));
                }
                return again(cx);
            }
            if self.in_flight.is_empty() {
                return Poll::Ready(Ok(()));
            }
            if worked {
                // Taking the oldest chunk back, once landed, is a driver call.
                return again(cx);
            }
            let front = self.in_flight.front_mut().expect("not empty");
            let index = front.index;
            let polled = match front.landed.as_mut().expect("marked at the top") {
                Landed::Word(future) => Pin::new(future).poll(cx),
                Landed::Event(event) => {
                    // Registered with the reactor once, on the first poll that waits for it.
                    if !matches!(&self.waiting, Some((i, _)) if *i == index) {
                        match cuweave_event::event_done(Arc::clone(event)) {
                            Ok(future) => self.waiting = Some((index, future)),
                            Err(error) => return Poll::Ready(Err(error.into())),
                        }
                    }
                    let (_, future) = self.waiting.as_mut().expect("set just above");
                    Pin::new(future).poll(cx)
                }
            };
            match polled {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(error.into())),
                Poll::Ready(Ok(())) => {
                    self.waiting = None;
                    let front = self.in_flight.pop_front().expect("looked at above");
                    // The mark has passed: this returns at once.
                    let block = match front.copy.wait() {
                        Ok(block) => block,
                        Err(error) => return Poll::Ready(Err(error.into())),
                    };
                    match self.direction {
                        Direction::Upload { .. } => self.give_back(block),
                        Direction::Download { .. } => {
                            self.partial = Some(Partial {
                                index: front.index,
                                block,
                                done: 0,
                            });
                        }
                    }
                    return again(cx);
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
            return Poll::Ready(Err(already_polled(this.plan.path)));
        }
        let started = *this.started.get_or_insert_with(Instant::now);
        match this.step(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(outcome) => {
                this.finished = true;
                let (bytes, elapsed) = (this.len() * size_of::<T>(), started.elapsed());
                // Counted as `TransferManager::run` counts a blocking transfer: an empty one
                // not at all.
                if bytes > 0 {
                    match &outcome {
                        Ok(()) => this.stats.record_success(this.plan.path, bytes, elapsed),
                        Err(_) => this.stats.record_failure(this.plan.path, bytes),
                    }
                }
                Poll::Ready(outcome.map(|()| TransferReport {
                    plan: this.plan.clone(),
                    bytes,
                    elapsed,
                }))
            }
        }
    }
}

fn already_polled(path: TransferPath) -> TransferError {
    TransferError::AlreadyCompleted {
        path: path.to_string(),
    }
}

impl TransferManager {
    /// Starts uploading `src` into `dst` from element `offset`, as a future (see
    /// [`AsyncTransfer`]): chunks go through pinned blocks on `dst`'s device, on a lane of its
    /// own, woken by the event layer; each poll copies at most [`POLL_BYTES`]. `src` and `dst`
    /// stay borrowed until the future completes or is dropped. For full speed on large
    /// transfers, [`upload_owned`](Self::upload_owned). Counted in [`stats`](Self::stats) once
    /// it completes.
    ///
    /// Opens the device on first use (making its context: milliseconds, once, here rather
    /// than in a poll).
    ///
    /// # Errors
    /// `OutOfRange` when `src` does not fit `dst` from `offset` (before anything is queued); the
    /// driver's error when the device cannot be opened.
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
        self.start_async(
            Direction::Upload { src, dst, offset },
            device,
            plan,
            src.len(),
        )
    }

    /// Starts downloading `dst.len()` elements of `src` from element `offset` into `dst`, as a
    /// future (see [`AsyncTransfer`]). `dst` is written only while the future is polled, and
    /// holds the data once it resolves.
    ///
    /// # Errors
    /// As [`upload_async`](Self::upload_async).
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
        self.start_async(Direction::Download { src, offset, dst }, device, plan, len)
    }

    fn start_async<'a, T: Element>(
        &'a self,
        direction: Direction<'a, T>,
        device: usize,
        plan: Plan,
        len: usize,
    ) -> Result<AsyncTransfer<'a, T>> {
        let chunk = match self.fixed_staging() {
            Some(fixed) => fixed.chunk_elements::<T>(),
            None => (ASYNC_CHUNK_BYTES / size_of::<T>().max(1)).max(1),
        };
        let depth = self.fixed_staging().map_or(3, |f| f.depth).max(2);
        let lane = self.lane(device)?;
        // What a first poll would otherwise pay once (starting the global waiter's reactor
        // thread, looking up the context's event pool), paid here instead, outside any poll.
        cuweave_event::AsyncEventWaiter::global()?;
        let events = EventPool::for_context(lane.stream().context())?;
        Ok(AsyncTransfer {
            direction,
            lane,
            plan,
            chunk,
            depth,
            chunks: len.div_ceil(chunk),
            next: 0,
            in_flight: VecDeque::new(),
            partial: None,
            filled: None,
            blocks: None,
            requested: None,
            waiting: None,
            words: true,
            events,
            started: None,
            finished: false,
            stats: self.stats(),
        })
    }
}
