//! Retiring mapped words ([`MappedWords`](super::MappedWords)) that device writes may still
//! reach, without making the dropping thread wait: one thread of the process (the *retirement
//! thread*) waits for their context, and their pages are kept for the next words.
//!
//! Nothing short of the whole context proves that every write queued into mapped words has
//! landed (the writes come from any stream of the context, and an event behind each one would
//! cost every wait a driver call). That wait (`cuCtxSynchronize`) also waits for unrelated
//! work, a long kernel on another stream; made on the dropping thread, it turned the drop of a
//! waiter or of a stream's marks into a wait for whatever else the GPU was doing. Here the
//! dropping thread only hands the allocation over ([`retire`]). The retirement thread
//! synchronises each context once per round, for every allocation of it sent before. While a
//! cuweave capture is active that is refused (it would wait on the capturing streams) and
//! retried a little later. A context whose synchronisation fails otherwise (a dead context)
//! leaks its allocations, so a write that still lands finds them mapped.
//!
//! Then the pages are not freed but kept, up to [`MOST_SPARE_WORD_BYTES`], for the next
//! [`MappedWords::new`](super::MappedWords::new) of that context and size ([`take_spare`]):
//! `cuMemFreeHost` waits for the whole device and holds the driver's lock meanwhile, so
//! launches on every thread would wait for it. A program that makes and drops waiters for days
//! reuses the same few pages. The pages go back to the driver with
//! [`empty_process_caches`](crate::empty_process_caches) ("mapped word pages"); pages still
//! waiting for their context then are kept when their wait ends (a later call frees them).
//! Pages past the bound, and pages of borrowed contexts, are freed (`cuMemFreeHost`) by
//! whichever thread lets them go.
//! [`host_allocations_awaiting_free`] counts what waits for its context. Where the thread cannot
//! be started, the wait happens on the dropping thread, as it always did.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crossbeam::channel::{self, Receiver, RecvTimeoutError, Sender};
use parking_lot::Mutex;

use super::HostAllocation;
use crate::context::Context;
use crate::graph::{CaptureMode, CaptureModeGuard};

/// The most bytes of retired mapped-word pages kept for reuse, counted as the pinned pages they
/// take (a one-word allocation still pins a page); pages past it are freed.
pub const MOST_SPARE_WORD_BYTES: usize = 4 << 20;

/// The least host memory one pinned allocation takes: a page.
const PINNED_PAGE: usize = 4 << 10;

/// What `page` takes of [`MOST_SPARE_WORD_BYTES`]: its length rounded up to whole pages.
fn footprint(page: &HostAllocation) -> usize {
    page.len().next_multiple_of(PINNED_PAGE)
}

/// How long the retirement thread first waits before asking again for a synchronisation that a
/// capture refused; doubled on each refusal up to [`MOST_RETRY`].
const FIRST_RETRY: Duration = Duration::from_millis(1);
const MOST_RETRY: Duration = Duration::from_millis(100);

/// Allocations sent to the retirement thread and not yet synchronised (or leaked).
static AWAITING: AtomicUsize = AtomicUsize::new(0);

/// The retirement thread's inbox; `None` when the thread could not be started.
static INBOX: OnceLock<Option<Sender<HostAllocation>>> = OnceLock::new();

/// Retired pages no queued write can reach any more, for reuse, and their bytes.
static SPARE: Mutex<(Vec<HostAllocation>, usize)> = Mutex::new((Vec::new(), 0));

thread_local! {
    /// Whether this is the retirement thread.
    static RETIREMENT_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// How many dropped mapped-word allocations (dropped after device writes were queued into
/// them) wait on the retirement thread for their context's queued work.
///
/// Each is done once its context has finished the work queued before it was dropped (and no
/// cuweave capture is active then): 0 again soon after the GPU goes idle.
pub fn host_allocations_awaiting_free() -> usize {
    AWAITING.load(Ordering::Acquire)
}

/// Sends `allocation` to the retirement thread, which keeps it as a spare (or frees it) once
/// every device write queued into it so far has landed; the dropping thread waits for nothing.
/// Without the thread, the wait happens here.
pub(crate) fn retire(allocation: HostAllocation) {
    // A borrowed context may be destroyed by its owner as soon as the caller's handles are
    // gone: nothing of it is held beyond this call, as before there was a thread.
    let allocation = if RETIREMENT_THREAD.get() || allocation.context().is_borrowed() {
        allocation
    } else {
        AWAITING.fetch_add(1, Ordering::AcqRel);
        let sent = match INBOX.get_or_init(start) {
            Some(inbox) => inbox.send(allocation).map_err(|channel::SendError(a)| a),
            None => Err(allocation),
        };
        match sent {
            Ok(()) => return,
            Err(allocation) => {
                AWAITING.fetch_sub(1, Ordering::AcqRel);
                allocation
            }
        }
    };
    let refused = retire_batch(vec![allocation], false);
    if !refused.is_empty() {
        tracing::warn!(
            "a capture refused the wait for queued writes into mapped host memory; leaking it instead of freeing"
        );
        refused.into_iter().for_each(std::mem::forget);
    }
}

/// A retired page of `bytes` in `context`, all of whose queued writes have landed, to reuse.
pub(crate) fn take_spare(context: &Arc<Context>, bytes: usize) -> Option<HostAllocation> {
    if context.is_borrowed() {
        return None;
    }
    let mut spare = SPARE.lock();
    let (pages, held) = &mut *spare;
    let at = pages
        .iter()
        .position(|page| page.len() == bytes && page.context().as_raw() == context.as_raw())?;
    let page = pages.swap_remove(at);
    *held -= footprint(&page);
    Some(page)
}

/// Keeps `page` (no queued write can reach it) for reuse, or frees it past the bound.
pub(crate) fn keep_spare(page: HostAllocation) {
    // Pages of a borrowed context are not kept: the cache would outlive the owner's context.
    if page.context().is_borrowed() {
        drop(page);
        return;
    }
    let mut spare = SPARE.lock();
    let (pages, held) = &mut *spare;
    if *held + footprint(&page) <= MOST_SPARE_WORD_BYTES {
        *held += footprint(&page);
        pages.push(page);
        return;
    }
    drop(spare);
    drop(page);
}

/// Frees the spare pages (the "mapped word pages" process cache); the bytes freed.
fn empty_spares() -> usize {
    let pages = {
        let mut spare = SPARE.lock();
        spare.1 = 0;
        std::mem::take(&mut spare.0)
    };
    let bytes = pages.iter().map(HostAllocation::len).sum();
    drop(pages);
    bytes
}

fn start() -> Option<Sender<HostAllocation>> {
    crate::process_caches::register_process_cache("mapped word pages", empty_spares);
    let (sender, receiver) = channel::unbounded();
    let started = std::thread::Builder::new()
        .name("cuweave-word-retirement".into())
        .spawn(move || run(&receiver));
    match started {
        Ok(_) => Some(sender),
        Err(error) => {
            tracing::warn!(%error, "no word-retirement thread: dropping mapped words waits for their context");
            None
        }
    }
}

/// The retirement thread: gathers what arrives, synchronises each context once per round, keeps
/// what that covers, and retries, after a pause, what a capture refused.
fn run(inbox: &Receiver<HostAllocation>) {
    RETIREMENT_THREAD.set(true);
    // Its synchronisations are recorded by no capture: a global-mode capture on another
    // thread must not refuse them. (They are made only while no cuweave capture is active and
    // none can begin, see `retire_batch`: a synchronisation into a capture would invalidate
    // it whatever the modes. A capture begun outside cuweave is not seen.)
    let _relaxed = CaptureModeGuard::enter(CaptureMode::Relaxed)
        .inspect_err(
            |error| tracing::warn!(%error, "word retirement runs outside relaxed capture mode"),
        )
        .ok();
    let mut waiting = Unfreed(Vec::new());
    let waiting = &mut waiting.0;
    let mut pause = FIRST_RETRY;
    loop {
        let next = if waiting.is_empty() {
            inbox.recv().map_err(|_| RecvTimeoutError::Disconnected)
        } else {
            inbox.recv_timeout(pause)
        };
        match next {
            Ok(allocation) => waiting.push(allocation),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        waiting.extend(inbox.try_iter());
        let before = waiting.len();
        *waiting = retire_batch(std::mem::take(waiting), true);
        pause = if waiting.len() < before {
            FIRST_RETRY
        } else {
            (pause * 2).min(MOST_RETRY)
        };
    }
}

/// The allocations the retirement thread waits for: leaked, never freed, if the thread ever
/// stops with them (a panic unwinding it), since writes may still be queued into them.
struct Unfreed(Vec<HostAllocation>);

impl Drop for Unfreed {
    fn drop(&mut self) {
        self.0.drain(..).for_each(std::mem::forget);
    }
}

/// Synchronises the context of each allocation in `batch` once and keeps as spares (or, for a
/// context that failed, leaks) what it covers; returns the allocations whose synchronisation a
/// capture refused, to try again. `counted`: the batch was counted in [`AWAITING`].
fn retire_batch(batch: Vec<HostAllocation>, counted: bool) -> Vec<HostAllocation> {
    let mut refused = Vec::new();
    let mut rest = batch;
    while let Some(first) = rest.first() {
        let context = Arc::clone(first.context());
        let (same, others): (Vec<_>, Vec<_>) = rest
            .into_iter()
            .partition(|allocation| allocation.context().as_raw() == context.as_raw());
        rest = others;
        let count = same.len();
        // `Context::synchronize` checks and synchronises with no capture beginning in between:
        // a synchronisation into a capture would invalidate it.
        match context.synchronize() {
            Ok(()) => same.into_iter().for_each(keep_spare),
            Err(error) if refused_by_a_capture(&error) => {
                refused.extend(same);
                continue;
            }
            Err(error) => {
                same.into_iter().for_each(std::mem::forget);
                tracing::warn!(
                    %error,
                    allocations = count,
                    "cannot wait for queued writes into mapped host memory; leaking it instead of freeing"
                );
            }
        }
        if counted {
            AWAITING.fetch_sub(count, Ordering::AcqRel);
        }
    }
    refused
}

/// Whether a synchronisation failed because a capture is under way (cuweave's own refusal, or
/// the driver's `CUDA_ERROR_STREAM_CAPTURE_*` for a capture begun outside cuweave): worth
/// asking again once it ends, unlike a dead context.
fn refused_by_a_capture(error: &crate::DriverError) -> bool {
    error.is_capture_refusal() || error.code().is_some_and(crate::graph::is_capture_code)
}
