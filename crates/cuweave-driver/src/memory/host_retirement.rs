//! Freeing mapped host memory that queued device writes may still reach, without making the
//! dropping thread wait for them: [`retire`] hands the allocation to one thread of the process,
//! which waits for the allocation's context to finish its queued work and then frees it.
//!
//! Why a thread: nothing short of the whole context proves that every write queued into a
//! [`MappedWords`](super::MappedWords) has landed (the writes come from any stream of the
//! context, and an event behind each one would cost every wait a driver call). That wait
//! (`cuCtxSynchronize`) also waits for unrelated work, a long kernel on another stream; so does
//! `cuMemFreeHost`, which may synchronise the device. Made on the dropping thread, both turned
//! the drop of a waiter or of a stream's marks into a wait for whatever else the GPU was doing.
//! Here the dropping thread only sends the allocation; the retirement thread waits.
//!
//! The retirement thread batches: one context synchronisation frees every allocation of that
//! context sent before it began. While a cuweave capture is active the synchronisation is
//! refused (it would wait on the capturing streams); the thread retries a little later, so the
//! memory is freed once the capture ends. A context whose synchronisation fails otherwise (a
//! dead context) leaks its allocations, as dropping did before: a write that still lands finds
//! them mapped. [`host_allocations_awaiting_free`] counts what waits.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};

use super::HostAllocation;
use crate::graph::{CaptureMode, CaptureModeGuard};

/// How long the retirement thread first waits before asking again for a synchronisation that a
/// capture refused; doubled on each refusal up to [`MOST_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(1);
const MOST_RETRY: Duration = Duration::from_millis(100);

/// Allocations sent to the retirement thread and not yet freed (or leaked).
static AWAITING: AtomicUsize = AtomicUsize::new(0);

/// The retirement thread's inbox; `None` when the thread could not be started.
static INBOX: OnceLock<Option<Sender<HostAllocation>>> = OnceLock::new();

/// How many host allocations (mapped words dropped after device writes were queued into them)
/// wait for their context's queued work before they are freed.
///
/// Each is freed once its context has finished the work queued before it was dropped (and no
/// cuweave capture is active then); it is 0 again soon after the GPU goes idle.
pub fn host_allocations_awaiting_free() -> usize {
    AWAITING.load(Ordering::Acquire)
}

/// Frees `allocation` once every device write queued into it so far has landed, without
/// waiting here: a thread of its own waits for the allocation's context to go idle, then frees
/// it. Where that thread cannot be started, the wait and the free happen here, as before.
pub(crate) fn retire(allocation: HostAllocation) {
    AWAITING.fetch_add(1, Ordering::AcqRel);
    let inbox = INBOX.get_or_init(start);
    let allocation = match inbox {
        Some(inbox) => match inbox.send(allocation) {
            Ok(()) => return,
            // The thread is gone (it panicked): retire here.
            Err(channel::SendError(allocation)) => allocation,
        },
        None => allocation,
    };
    let refused = retire_batch(vec![allocation]);
    if !refused.is_empty() {
        tracing::warn!(
            "a capture refused the wait for queued writes into mapped host memory; leaking it instead of freeing"
        );
        AWAITING.fetch_sub(refused.len(), Ordering::AcqRel);
        refused.into_iter().for_each(std::mem::forget);
    }
}

fn start() -> Option<Sender<HostAllocation>> {
    let (sender, receiver) = channel::unbounded();
    let started = std::thread::Builder::new()
        .name("cuweave-host-retirement".into())
        .spawn(move || run(&receiver));
    match started {
        Ok(_) => Some(sender),
        Err(error) => {
            tracing::warn!(%error, "no host-retirement thread: mapped words are freed on the dropping thread");
            None
        }
    }
}

/// The retirement thread: gathers what arrives, synchronises each context once per round, and
/// frees what that synchronisation covers; retries, after a pause, what a capture refused.
fn run(inbox: &Receiver<HostAllocation>) {
    // Its synchronisations and frees are recorded by no capture: a global-mode capture on
    // another thread must not refuse them (nor be invalidated by them).
    let _relaxed = CaptureModeGuard::enter(CaptureMode::Relaxed)
        .inspect_err(
            |error| tracing::warn!(%error, "host retirement runs outside relaxed capture mode"),
        )
        .ok();
    let mut waiting: Vec<HostAllocation> = Vec::new();
    let mut pause = FIRST_RETRY;
    loop {
        if waiting.is_empty() {
            match inbox.recv() {
                Ok(allocation) => waiting.push(allocation),
                Err(_) => return,
            }
        } else {
            match inbox.recv_timeout(pause) {
                Ok(allocation) => waiting.push(allocation),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
        }
        waiting.extend(inbox.try_iter());
        let before = waiting.len();
        waiting = retire_batch(waiting);
        pause = if waiting.len() < before {
            FIRST_RETRY
        } else {
            (pause * 2).min(MOST_RETRY)
        };
    }
}

/// Synchronises the context of each allocation in `batch` once and frees (or, for a context
/// that failed, leaks) what it covers; returns the allocations whose synchronisation a capture
/// refused, to try again.
fn retire_batch(batch: Vec<HostAllocation>) -> Vec<HostAllocation> {
    let mut refused = Vec::new();
    let mut rest = batch;
    while let Some(first) = rest.first() {
        let context = std::sync::Arc::clone(first.context());
        let (same, others): (Vec<_>, Vec<_>) = rest
            .into_iter()
            .partition(|allocation| allocation.context().as_raw() == context.as_raw());
        rest = others;
        let count = same.len();
        match context.synchronize() {
            Ok(()) => {
                drop(same);
                AWAITING.fetch_sub(count, Ordering::AcqRel);
            }
            Err(error) if refused_by_a_capture(&error) => refused.extend(same),
            Err(error) => {
                tracing::warn!(
                    %error,
                    allocations = count,
                    "cannot wait for queued writes into mapped host memory; leaking it instead of freeing"
                );
                same.into_iter().for_each(std::mem::forget);
                AWAITING.fetch_sub(count, Ordering::AcqRel);
            }
        }
    }
    refused
}

/// Whether a synchronisation failed because a capture is under way (cuweave's own refusal, or
/// the driver's `CUDA_ERROR_STREAM_CAPTURE_*` for a capture begun outside cuweave): worth
/// asking again once it ends, unlike a dead context.
fn refused_by_a_capture(error: &crate::DriverError) -> bool {
    error.is_capture_refusal()
        || error
            .code()
            .is_some_and(|code| (900..=907).contains(&code.0))
}
