//! Beginning and ending a capture on a [`Stream`]: `begin_capture`,
//! `begin_capture_synchronized`, `end_capture`, and the end of a capture still active when its
//! stream is dropped.

use std::sync::atomic::Ordering;

use super::failures::{FAILURE_SEQ, invalidated_since};
use super::mode::CaptureMode;
use super::registry::{
    BLOCKING, CAPTURE_BEGIN, COUNT_BITS, CaptureState, ENDED, GLOBAL, RECORDS, Record, STATE,
    active_captures, while_no_capture_begins,
};
use crate::error::{DriverError, Result};
use crate::graph::error::GraphError;
use crate::graph::handle::Graph;
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

/// Whether `raw` is the legacy default stream (null or `CU_STREAM_LEGACY`).
pub(super) fn is_legacy_default(raw: sys::CUstream) -> bool {
    raw as usize <= 1
}

/// The known-complete bound of a capture that [`Stream::begin_capture_synchronized`] is about
/// to begin: the epoch `synchronize` returns (it bumps the epoch and synchronises the context)
/// when no capture of the context is active (`active_captures` counts those); otherwise, or
/// when `synchronize` is refused because a capture began on another thread meanwhile
/// ([`GraphError::Capturing`]), the bound `inherited` from the active captures of the same
/// context.
///
/// `inherited` is read only after the attempt: a capture that refused the synchronisation was
/// recorded, bound included, before it was counted, so a begin that lost the race to another
/// thread's synchronised begin inherits that capture's bound (valid for good: its work was
/// complete at a point before this capture begins). Read before the attempt, it would miss that
/// capture and leave this one with no bound, so every buffer used before it would look
/// unfinished. When every capture ended meanwhile (nothing inherited, none active), the
/// synchronisation is tried again.
pub(super) fn synchronized_bound(
    active_captures: impl Fn() -> usize,
    mut synchronize: impl FnMut() -> Result<u64>,
    inherited: impl Fn() -> u64,
) -> Result<u64> {
    loop {
        if active_captures() == 0 {
            match synchronize() {
                Ok(epoch) => return Ok(epoch),
                // Another thread began a capture meanwhile: inherit from it below.
                Err(DriverError::Graph(GraphError::Capturing { .. })) => {}
                Err(error) => return Err(error),
            }
        }
        let bound = inherited();
        if bound != 0 || active_captures() != 0 {
            return Ok(bound);
        }
    }
}

impl Stream {
    /// Starts recording the work queued on this stream (and on streams that wait on events
    /// recorded in it) into a graph, instead of running it. `cuStreamBeginCapture_v2`.
    ///
    /// End with [`end_capture`](Self::end_capture) on this same stream.
    ///
    /// Work queued before it is not waited for: buffer trackers treat every use recorded before
    /// such a capture as possibly running (a capturing stream that would wait on one gets
    /// [`GraphError::Capturing`]). [`begin_capture_synchronized`](Self::begin_capture_synchronized)
    /// makes that work finish first.
    ///
    /// # Errors
    /// [`GraphError::LegacyDefaultStream`] for the legacy default stream;
    /// [`GraphError::AlreadyCapturing`] when this stream is capturing (begun through this handle, an
    /// alias of its `CUstream`, or another library); [`GraphError::Capturing`] when called
    /// inside [`outside_captures`](crate::graph::outside_captures) on this thread (the begin
    /// would wait for that call to return); the driver's error otherwise.
    pub fn begin_capture(&self, mode: CaptureMode) -> Result<()> {
        self.check_can_capture()?;
        let complete_before = self.inherited_complete_before();
        self.begin_capture_recorded(mode, complete_before)
    }

    /// [`begin_capture`](Self::begin_capture) after the context's earlier work has finished,
    /// as PyTorch's `torch.cuda.graph` does (`torch.cuda.synchronize()` before
    /// `capture_begin`): bumps the capture epoch, synchronises the context (`cuCtxSynchronize`),
    /// then begins. Every use a buffer tracker recorded in this context before the bump is then
    /// known to be complete ([`known_complete_before`]), so a capturing stream drops it instead
    /// of waiting on an event recorded outside the capture (which the driver refuses).
    ///
    /// When another capture of the same context is already active the context cannot be
    /// synchronised (that would wait on, or break, the capturing streams): the capture begins
    /// without it and inherits the bound of an active capture of the context, read after the
    /// synchronisation was found impossible, so that a capture another thread began meanwhile
    /// (its own synchronisation just done) is inherited from too. Captures of other contexts do
    /// not stop it: this context alone is synchronised, in relaxed capture mode, so a program
    /// capturing one rank per device from one thread (`nccl-tests -G`) may warm up the buffers
    /// of every rank first.
    ///
    /// # Errors
    /// As [`begin_capture`](Self::begin_capture), and the synchronisation's error (a kernel that
    /// faulted earlier, ...), in which case no capture is begun.
    ///
    /// [`known_complete_before`]: super::known_complete_before
    pub fn begin_capture_synchronized(&self, mode: CaptureMode) -> Result<()> {
        self.check_can_capture()?;
        let complete_before = synchronized_bound(
            || self.captures_in_context(),
            || {
                // No capture can begin between the check and the synchronisation, which would
                // invalidate one of this context.
                while_no_capture_begins(|| {
                    if self.captures_in_context() != 0 {
                        return Err(GraphError::Capturing {
                            operation: "Stream::begin_capture_synchronized",
                            reason: "a capture of this context began meanwhile",
                        }
                        .into());
                    }
                    let epoch =
                        CaptureState::from_word(STATE.fetch_add(1 << COUNT_BITS, Ordering::SeqCst))
                            .epoch
                            + 1;
                    // Captures of other contexts (another device's rank, in a one-thread
                    // multi-GPU capture) are not waited on by this context's synchronisation;
                    // relaxed mode keeps the driver from refusing it under their mode.
                    let _relaxed = super::relaxed_during_captures()?;
                    self.context().synchronize_beside_captures()?;
                    Ok(epoch)
                })
            },
            || self.inherited_complete_before(),
        )?;
        self.begin_capture_recorded(mode, complete_before)
    }

    /// How many captures begun through cuweave are active on this stream's context.
    fn captures_in_context(&self) -> usize {
        if active_captures() == 0 {
            return 0;
        }
        let raw = self.context().as_raw() as usize;
        RECORDS
            .lock()
            .iter()
            .filter(|record| record.context == raw)
            .count()
    }

    fn check_can_capture(&self) -> Result<()> {
        // A begin waits for every thread inside `outside_captures` to leave it; made from
        // inside one, it would wait for itself as soon as another thread's begin held the
        // begin lock first (that one waiting for this thread's section, this one for the lock).
        if super::outside::inside_on_this_thread() {
            return Err(GraphError::Capturing {
                operation: "Stream::begin_capture",
                reason: "called inside `outside_captures`, which holds every capture begin off until it returns",
            }
            .into());
        }
        if super::registry::holding_capture_begins_off() {
            return Err(GraphError::Capturing {
                operation: "Stream::begin_capture",
                reason: "called inside `WeakStream::with_no_capture_beginning` (or another section that holds capture begins off), which would wait for itself",
            }
            .into());
        }
        if is_legacy_default(self.as_raw()) {
            return Err(GraphError::LegacyDefaultStream {
                operation: "Stream::begin_capture",
            }
            .into());
        }
        if RECORDS
            .lock()
            .iter()
            .any(|record| record.stream == self.id())
        {
            return Err(GraphError::AlreadyCapturing { stream: self.id() }.into());
        }
        // The same `CUstream` may capture through another handle (a borrowed alias of it, or a
        // library's own capture): asking its flags below would then break that capture (the
        // driver refuses `cuStreamGetFlags` on a capturing stream and invalidates it). The
        // capture-info query is legal during a capture.
        if matches!(self.capture_status(), Ok(status) if status.id().is_some()) {
            return Err(GraphError::AlreadyCapturing { stream: self.id() }.into());
        }
        Ok(())
    }

    /// The largest known-complete bound of the captures active on this stream's context.
    fn inherited_complete_before(&self) -> u64 {
        let raw = self.context().as_raw() as usize;
        RECORDS
            .lock()
            .iter()
            .filter(|record| record.context == raw)
            .map(|record| record.complete_before)
            .max()
            .unwrap_or(0)
    }

    fn begin_capture_recorded(&self, mode: CaptureMode, complete_before: u64) -> Result<()> {
        // Asked once, before the capture: while a blocking stream captures, any use of its
        // context's legacy default stream breaks the capture (`refuse_legacy_stream_use`).
        // Unknown counts as blocking: a refusal too many costs a retry, a use too many the graph.
        let blocking = self.flags().map_or(true, |flags| !flags.is_non_blocking());
        self.context().bind_to_thread()?;
        let api = driver()?;
        // Until the capture is counted: see `while_no_capture_begins` (whose holders, perhaps
        // synchronising for long, go first) and then `outside_captures` (callers already inside
        // finish first; queries made meanwhile wait only for the few calls below).
        let _beginning = CAPTURE_BEGIN.write();
        let _announced = super::outside::announce_capture_begin();
        // No lock across the call: a failure goes through `note_driver_failure`, which locks.
        // SAFETY: live stream of the current context; the mode is a valid enum value.
        unsafe { cu!(api.stream_begin_capture(self.as_raw(), mode.to_sys())) }?;
        let capture_id = match self.capture_status() {
            Ok(status) => status.id().unwrap_or(0),
            Err(error) => {
                tracing::warn!(%error, "reading a new capture's id failed; uses recorded in it are not recognised");
                0
            }
        };
        RECORDS.lock().push(Record {
            stream: self.id(),
            mode,
            first_failure: FAILURE_SEQ.load(Ordering::Acquire),
            capture_id,
            context: self.context().as_raw() as usize,
            complete_before,
            thread: std::thread::current().id(),
            tracked: false,
            blocking,
        });
        if blocking {
            BLOCKING.fetch_add(1, Ordering::AcqRel);
        }
        STATE.fetch_add(1, Ordering::AcqRel);
        if mode == CaptureMode::Global {
            GLOBAL.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Ends the capture begun on this stream and returns what it recorded.
    /// `cuStreamEndCapture`.
    ///
    /// # Errors
    /// [`GraphError::NotCapturing`] when no capture was begun on this stream through cuweave
    /// (for instance, ending on a stream that was only forked into the capture), without
    /// touching the capture; [`GraphError::CaptureInvalidated`] naming the first call that broke
    /// it; [`GraphError::UnjoinedFork`] when a forked stream was not joined back. Either way the
    /// capture is over and the stream usable again.
    pub fn end_capture(&self) -> Result<Graph> {
        let record = {
            let records = RECORDS.lock();
            records
                .iter()
                .find(|record| record.stream == self.id())
                .copied()
        };
        let Some(record) = record else {
            return Err(GraphError::NotCapturing {
                operation: "Stream::end_capture",
                stream: self.id(),
            }
            .into());
        };
        self.context().bind_to_thread()?;
        let api = driver()?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: live stream; valid out-pointer.
        let ended = unsafe { cu!(api.stream_end_capture(self.as_raw(), &mut raw)) };
        let over = match &ended {
            Ok(()) => true,
            Err(error) => !matches!(
                error.code(),
                Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD)
            ),
        };
        if over {
            self.forget_capture(record);
        }
        match ended {
            Ok(()) if !raw.is_null() => {
                // SAFETY: the driver just created this graph and hands it to us.
                let graph = unsafe { Graph::from_raw(self.context(), raw) };
                Ok(graph.with_tracked_capture(record.tracked.then_some(record.capture_id)))
            }
            Ok(()) => Err(invalidated_since(
                record.first_failure,
                record.blamed_thread(),
            )),
            Err(DriverError::Graph(GraphError::CaptureInvalidated { .. })) => Err(
                invalidated_since(record.first_failure, record.blamed_thread()),
            ),
            Err(error) => Err(match error.code() {
                Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNJOINED) => {
                    GraphError::UnjoinedFork.into()
                }
                Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED) => {
                    invalidated_since(record.first_failure, record.blamed_thread())
                }
                _ => error,
            }),
        }
    }

    fn forget_capture(&self, record: Record) {
        RECORDS.lock().retain(|other| other.stream != record.stream);
        ENDED.fetch_add(1, Ordering::AcqRel);
        STATE.fetch_sub(1, Ordering::AcqRel);
        if record.mode == CaptureMode::Global {
            GLOBAL.fetch_sub(1, Ordering::AcqRel);
        }
        if record.blocking {
            BLOCKING.fetch_sub(1, Ordering::AcqRel);
        }
        super::registry::signal_capture_end();
    }

    /// At drop: ends a capture begun through cuweave on this stream and never ended, and
    /// destroys what it recorded, so that the process does not count it as active for ever
    /// (which would refuse every blocking call on the thread that began it). The capture is
    /// over either way: the stream is about to be destroyed.
    pub(crate) fn abandon_capture(&self) {
        if active_captures() == 0 {
            return;
        }
        let record = RECORDS
            .lock()
            .iter()
            .find(|record| record.stream == self.id())
            .copied();
        let Some(record) = record else { return };
        let Ok(api) = driver() else { return };
        let mut raw = std::ptr::null_mut();
        // SAFETY: live stream (dropped only after this returns); valid out-pointer.
        match unsafe { cu!(api.stream_end_capture(self.as_raw(), &mut raw)) } {
            Ok(()) if !raw.is_null() => {
                // SAFETY: the driver just made this graph and hands it to us; dropped at once.
                drop(unsafe { Graph::from_raw(self.context(), raw) });
            }
            Ok(()) => {}
            // A global or thread-local capture ends only on the thread that began it: the
            // stream is destroyed anyway, and its record forgotten (kept, it would count the
            // capture as active for as long as the process runs).
            Err(error)
                if error.code() == Some(sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD) =>
            {
                tracing::warn!(
                    stream = self.id(),
                    "a capturing stream was dropped on another thread than the one that began its capture: the driver refused to end the capture there; drop capturing streams on their capture's thread"
                );
            }
            Err(error) => {
                tracing::warn!(%error, "ending the capture of a stream being dropped failed");
            }
        }
        tracing::debug!(
            stream = self.id(),
            "a stream was dropped while capturing: its capture was ended and discarded"
        );
        self.forget_capture(record);
    }
}
