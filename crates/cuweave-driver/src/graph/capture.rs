//! Stream capture: begin and end a capture on a [`Stream`], its status, the thread's capture
//! mode, and the process-wide bookkeeping that lets other code ask "is a capture active?" for
//! the price of one atomic load.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use super::error::{GraphError, capture_error_name, is_capture_code};
use super::handle::Graph;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

/// How strictly the driver guards a capture against calls that are unsafe during it
/// (`cuMemAlloc`, synchronisation, querying an event recorded before the capture, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureMode {
    /// Unsafe calls from *any* thread not in relaxed mode break the capture.
    Global,
    /// Unsafe calls from the capturing thread break the capture; other threads are free.
    /// cuweave's default: event pollers and allocators on other threads keep working.
    ThreadLocal,
    /// Nothing is checked; the caller promises not to make unsafe calls.
    Relaxed,
}

impl CaptureMode {
    fn to_sys(self) -> sys::CUstreamCaptureMode {
        match self {
            Self::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
            Self::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            Self::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        }
    }

    fn from_sys(mode: sys::CUstreamCaptureMode) -> Self {
        match mode {
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL => Self::Global,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL => Self::ThreadLocal,
            _ => Self::Relaxed,
        }
    }
}

/// Where a stream stands with respect to capture (`cuStreamGetCaptureInfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CaptureStatus {
    /// Not capturing: work queued on it runs.
    None,
    /// Capturing into the capture sequence `id` (unique per process run).
    Active {
        /// The capture sequence's id; streams forked into one capture share it.
        id: u64,
    },
    /// The capture `id` was invalidated; it must still be ended.
    Invalidated {
        /// The capture sequence's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// Whether work queued now is recorded rather than run (active or invalidated capture).
    pub fn is_capturing(self) -> bool {
        !matches!(self, Self::None)
    }

    /// The capture sequence's id, when capturing.
    pub fn id(self) -> Option<u64> {
        match self {
            Self::None => None,
            Self::Active { id } | Self::Invalidated { id } => Some(id),
        }
    }
}

/// Captures begun through [`Stream::begin_capture`] and not yet ended (the low
/// [`COUNT_BITS`] bits), and the capture epoch (the bits above), in one word so that a hot path
/// reads both with one load ([`capture_state`]).
static STATE: AtomicU64 = AtomicU64::new(0);
/// Bits of [`STATE`] that count active captures.
const COUNT_BITS: u32 = 24;
/// Mask of the count in [`STATE`].
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;
/// Those of them in [`CaptureMode::Global`].
static GLOBAL: AtomicUsize = AtomicUsize::new(0);
/// Sequence number of driver failures with a capture error code.
static FAILURE_SEQ: AtomicU64 = AtomicU64::new(0);
/// How many capture failures [`FAILURES`] remembers; older ones are dropped.
const FAILURE_LOG: usize = 64;

/// A driver call that failed with a capture error while a capture was active.
#[derive(Debug, Clone, Copy)]
struct Failure {
    seq: u64,
    operation: &'static str,
    code: sys::CUresult,
    /// The thread that made the call: a thread-local capture is broken by its own thread's
    /// calls, so its end looks there first.
    thread: std::thread::ThreadId,
}

/// The most recent capture failures, oldest first (bounded by [`FAILURE_LOG`]).
static FAILURES: Mutex<VecDeque<Failure>> = Mutex::new(VecDeque::new());

/// A capture begun here: which stream, in which mode, the failure sequence at its start, the
/// driver's capture id, its context, and the epoch before which that context's work is known to
/// have completed.
#[derive(Debug, Clone, Copy)]
struct Record {
    stream: u64,
    mode: CaptureMode,
    first_failure: u64,
    capture_id: u64,
    context: usize,
    complete_before: u64,
    /// The thread that began the capture.
    thread: std::thread::ThreadId,
    /// A tracked buffer (of the memory layer) was used in the capture: its graph's launches
    /// leave fences (see `fences`).
    tracked: bool,
}

impl Record {
    /// The thread whose failed calls are looked at first when the capture turns out broken:
    /// its own, unless it is global, which any thread's unsafe call breaks (then the first
    /// failure anywhere is the cause).
    fn blamed_thread(&self) -> Option<std::thread::ThreadId> {
        (self.mode != CaptureMode::Global).then_some(self.thread)
    }
}

/// Every capture begun through cuweave and not yet ended (few at a time: one per capturing
/// stream), so that `end_capture` knows its mode and where to look for the call that broke it.
static RECORDS: Mutex<Vec<Record>> = Mutex::new(Vec::new());

/// Held exclusively while a capture begins (from before `cuStreamBeginCapture` until the
/// capture is counted in [`active_captures`]), and shared by [`while_no_capture_begins`]: a
/// background thread that checks for active captures and then synchronises a context (the
/// driver's host-retirement thread) cannot see none and then synchronise into a capture that
/// began in between, which would invalidate it.
static CAPTURE_BEGIN: parking_lot::RwLock<()> = parking_lot::RwLock::new(());

/// Runs `f` while no capture can begin through cuweave: for a check of [`active_captures`]
/// followed by a call that would invalidate a capture (a context synchronisation) made off the
/// thread whose program order would otherwise keep them apart. A capture about to begin waits
/// for `f` to return.
pub(crate) fn while_no_capture_begins<R>(f: impl FnOnce() -> R) -> R {
    let _no_begin = CAPTURE_BEGIN.read();
    f()
}

/// How many captures begun through cuweave are active in the process: one relaxed atomic load,
/// for hot paths that must behave differently while any capture runs.
#[inline]
pub fn active_captures() -> usize {
    (STATE.load(Ordering::Acquire) & COUNT_MASK) as usize
}

/// How many captures are active and the capture epoch, read together with one atomic load.
///
/// The epoch grows by one each time [`Stream::begin_capture_synchronized`] is about to
/// synchronise a context. Work queued in that context *before* a load that returned an epoch
/// below the capture's [`known_complete_before`] has finished when the capture begins: so a
/// buffer tracker that stamps each recorded use with the epoch read just after recording it
/// can drop, without querying, the uses a capturing stream would otherwise have to wait on.
#[inline]
pub fn capture_state() -> CaptureState {
    CaptureState::from_word(STATE.load(Ordering::SeqCst))
}

/// What [`capture_state`] returns: active captures and the capture epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CaptureState {
    /// Captures begun through cuweave and not yet ended.
    pub active: usize,
    /// The capture epoch (see [`capture_state`]).
    pub epoch: u64,
}

impl CaptureState {
    fn from_word(word: u64) -> Self {
        Self {
            active: (word & COUNT_MASK) as usize,
            epoch: word >> COUNT_BITS,
        }
    }
}

/// Notes that a tracked buffer was used in the active capture `capture_id` (begun through
/// cuweave): the graph it ends in then leaves a fence behind each launch, which eager work on
/// other streams that uses such a buffer waits for
/// ([`wait_for_graph_launches`](super::wait_for_graph_launches)). The memory layer calls it;
/// cheap when already noted.
pub fn note_tracked_use(capture_id: u64) {
    if let Some(record) = RECORDS
        .lock()
        .iter_mut()
        .find(|record| record.capture_id == capture_id)
    {
        record.tracked = true;
    }
}

/// Whether the capture sequence `capture_id` (as [`CaptureStatus::id`] reports it), begun through
/// cuweave, is still active.
pub fn capture_is_active(capture_id: u64) -> bool {
    RECORDS
        .lock()
        .iter()
        .any(|record| record.capture_id == capture_id)
}

/// The epoch before which every use stamped by `context`'s work is known to have completed,
/// for work captured into `capture_id`: the epoch taken just before the context synchronisation
/// of [`Stream::begin_capture_synchronized`] (or of an earlier capture still active on the same
/// context). 0 (nothing known) for a capture begun without that synchronisation, outside
/// cuweave, or on another context.
pub fn known_complete_before(capture_id: u64, context: &crate::Context) -> u64 {
    let raw = context.as_raw() as usize;
    let records = RECORDS.lock();
    let Some(record) = records
        .iter()
        .find(|record| record.capture_id == capture_id)
    else {
        return 0;
    };
    if record.context == raw {
        record.complete_before
    } else {
        0
    }
}

/// Called by the loader on every failed driver call: remembers capture errors while a capture
/// is active, so the capture's end can name the call that broke it.
pub(crate) fn note_driver_failure(code: sys::CUresult, operation: &'static str) {
    // `INVALIDATED` is what every call after the breaking one returns: not a cause.
    if active_captures() == 0
        || !is_capture_code(code)
        || code == sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED
    {
        return;
    }
    let seq = FAILURE_SEQ.fetch_add(1, Ordering::AcqRel) + 1;
    let oldest_wanted = RECORDS
        .lock()
        .iter()
        .map(|record| record.first_failure)
        .min()
        .unwrap_or(seq);
    let mut failures = FAILURES.lock();
    // Failures no active capture can ask about go first; when the log is still full, the newest
    // is dropped, since each capture reports the *first* call that broke it.
    while failures
        .front()
        .is_some_and(|failure| failure.seq <= oldest_wanted)
    {
        failures.pop_front();
    }
    if failures.len() == FAILURE_LOG {
        return;
    }
    failures.push_back(Failure {
        seq,
        operation,
        code,
        thread: std::thread::current().id(),
    });
}

/// The typed error for a call that failed because its capture was invalidated earlier: one
/// [`GraphError::CaptureInvalidated`] naming the first call that broke a capture, instead of the
/// driver's bare `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` on every call after it.
pub(crate) fn translate_driver_failure(code: sys::CUresult) -> Option<DriverError> {
    if code != sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED || active_captures() == 0 {
        return None;
    }
    let start = RECORDS
        .lock()
        .iter()
        .map(|record| record.first_failure)
        .min()?;
    Some(invalidated_since(start, Some(std::thread::current().id())))
}

/// The first capture failure after sequence number `after`, if still remembered: the first on
/// `thread` when there is one (another thread's failure may have broken another capture), else
/// the first on any thread.
fn first_failure_after(after: u64, thread: Option<std::thread::ThreadId>) -> Option<Failure> {
    let failures = FAILURES.lock();
    let mut since = failures.iter().filter(|failure| failure.seq > after);
    let first = since.clone().next().copied();
    thread
        .and_then(|thread| since.find(|failure| failure.thread == thread).copied())
        .or(first)
}

/// Whether the calling thread may make a call that capture forbids (an event query, a
/// synchronisation, `cuMemAlloc`) without breaking some active capture: `false` while this
/// thread has a global or thread-local capture, or any thread a global one, unless this thread
/// is in relaxed mode.
fn unsafe_calls_break_a_capture() -> Result<bool> {
    // Read from the records, not a thread-local count: a capture can be ended (or its stream
    // dropped) on another thread than the one that began it.
    if GLOBAL.load(Ordering::Acquire) == 0 && !this_thread_captures() {
        return Ok(false);
    }
    Ok(thread_capture_mode()? != CaptureMode::Relaxed)
}

/// The capture `stream` records into, or `None` when it is not capturing; one atomic load
/// while no capture begun through cuweave is active.
fn capture_of(stream: &Stream) -> Result<Option<u64>> {
    if active_captures() == 0 {
        return Ok(None);
    }
    Ok(stream.capture_status()?.id())
}

/// Refuses a wait of `dependent` on work just queued on `prerequisite` that would break a
/// capture, before it is queued: a capturing `dependent` may wait only on streams of its own
/// capture (the driver refuses a dependency across the capture's boundary,
/// `CUDA_ERROR_STREAM_CAPTURE_ISOLATION`, and invalidates the capture); the legacy default
/// stream may not wait on a capturing stream (it cannot join a capture). An eager stream that
/// waits on a capturing one joins its capture, as a fork does: allowed. One atomic load while no
/// capture begun through cuweave is active.
///
/// # Errors
/// [`GraphError::Capturing`] or [`GraphError::LegacyDefaultStream`] naming `operation`; the
/// driver's error when a capture status cannot be read.
pub fn refuse_wait_across_capture(
    dependent: &Stream,
    prerequisite: &Stream,
    operation: &'static str,
) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    refuse_dependency_across_capture(dependent, capture_of(prerequisite)?.into(), operation)
}

/// Where the work a wait depends on was queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RecordedIn {
    /// Not known (an event never recorded through cuweave): the driver decides.
    Unknown,
    /// On a stream that was not capturing.
    Eager,
    /// Into this capture.
    Capture(u64),
}

impl From<Option<u64>> for RecordedIn {
    fn from(capture: Option<u64>) -> Self {
        capture.map_or(Self::Eager, Self::Capture)
    }
}

/// [`refuse_wait_across_capture`] for work recorded where `prerequisite` says.
pub(crate) fn refuse_dependency_across_capture(
    dependent: &Stream,
    prerequisite: RecordedIn,
    operation: &'static str,
) -> Result<()> {
    let Some(capture) = capture_of(dependent)? else {
        if dependent.is_special_handle()
            && !dependent.is_per_thread_default()
            && matches!(prerequisite, RecordedIn::Capture(_))
        {
            return Err(GraphError::LegacyDefaultStream { operation }.into());
        }
        return Ok(());
    };
    match prerequisite {
        RecordedIn::Unknown => Ok(()),
        RecordedIn::Capture(other) if other == capture => Ok(()),
        RecordedIn::Eager | RecordedIn::Capture(_) => Err(GraphError::Capturing {
            operation,
            reason: "the waiting stream is capturing and the work it would wait for is not in its capture: a wait across a capture's boundary would invalidate the capture",
        }
        .into()),
    }
}

/// Puts this thread in relaxed capture mode while any capture begun through cuweave is active
/// (`None`, and no driver call, while none is): for a call that a capture does not record and
/// that is sound to make during one (allocating, freeing or pinning memory, loading or
/// unloading a module), which the driver would otherwise refuse under a global or thread-local
/// capture, breaking that capture. A capture begun outside cuweave while none of cuweave's is
/// active is not seen.
///
/// # Errors
/// The driver's error from `cuThreadExchangeStreamCaptureMode`.
pub fn relaxed_during_captures() -> Result<Option<CaptureModeGuard>> {
    (active_captures() != 0)
        .then(|| CaptureModeGuard::enter(CaptureMode::Relaxed))
        .transpose()
}

/// Whether this thread began a global or thread-local capture that is not over.
fn this_thread_captures() -> bool {
    let thread = std::thread::current().id();
    RECORDS
        .lock()
        .iter()
        .any(|record| record.thread == thread && record.mode != CaptureMode::Relaxed)
}

/// This thread's capture mode, read by exchanging it with itself.
fn thread_capture_mode() -> Result<CaptureMode> {
    let api = driver()?;
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: valid in-out pointer; exchanging is legal during capture.
    unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) }?;
    let current = mode;
    // SAFETY: as above; puts the original mode back.
    unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) }?;
    Ok(CaptureMode::from_sys(current))
}

/// Refuses, with [`GraphError::Capturing`], a call that would break an active capture:
/// one that blocks on or queries `stream` while it is capturing, or (with or without a stream)
/// any call capture forbids while this thread may not make it (see [`CaptureMode`]).
///
/// Costs one atomic load while no capture is active anywhere in the process.
///
/// # Errors
/// [`GraphError::Capturing`] naming `operation`; the driver's error when the status query fails.
#[inline]
pub fn refuse_while_capturing(stream: Option<&Stream>, operation: &'static str) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    refuse_while_capturing_slow(stream, operation)
}

#[cold]
fn refuse_while_capturing_slow(stream: Option<&Stream>, operation: &'static str) -> Result<()> {
    if let Some(stream) = stream
        && stream.capture_status()?.is_capturing()
    {
        return Err(GraphError::Capturing {
            operation,
            reason: "the stream is capturing: its work is recorded, not run, so there is nothing to wait for",
        }
        .into());
    }
    if unsafe_calls_break_a_capture()? {
        return Err(GraphError::Capturing {
            operation,
            reason: "a blocking call or event query now would invalidate the capture",
        }
        .into());
    }
    Ok(())
}

/// Refuses, with [`GraphError::Capturing`], queuing on `stream` work that must not be recorded
/// into a graph: work that is safe to run once but not to replay (a host function whose boxed
/// `FnOnce` is freed by its first run, a write into memory that may be freed before a later
/// launch of the graph). Unlike [`refuse_while_capturing`], it looks only at `stream`: queuing
/// such work on a stream that is not capturing is fine whatever else captures.
///
/// With [`StatusCheck::Always`] it asks the driver (`cuStreamIsCapturing`, one call) every time,
/// which also catches captures begun outside cuweave; with [`StatusCheck::WhileCuweaveCaptures`]
/// it costs one atomic load while no capture begun through cuweave is active, and asks the
/// driver only while one is (then it also catches streams forked into a capture and captures
/// begun outside cuweave). Whenever it asks the driver it first makes the stream's context
/// current on the calling thread, so callers need not: the null stream's capture status is that
/// of its thread's current context.
///
/// # Errors
/// [`GraphError::Capturing`] naming `operation` and `reason` when the stream is capturing
/// (active or invalidated capture); the driver's error when the stream's context cannot be
/// made current or the status query fails.
#[inline]
pub fn refuse_recording(
    stream: &Stream,
    check: StatusCheck,
    operation: &'static str,
    reason: &'static str,
) -> Result<()> {
    if check == StatusCheck::WhileCuweaveCaptures && active_captures() == 0 {
        return Ok(());
    }
    refuse_recording_slow(stream, operation, reason)
}

#[cold]
fn refuse_recording_slow(
    stream: &Stream,
    operation: &'static str,
    reason: &'static str,
) -> Result<()> {
    // The null stream's capture status is its thread's current context's.
    stream.context().bind_to_thread()?;
    if stream.is_capturing()? {
        return Err(GraphError::Capturing { operation, reason }.into());
    }
    Ok(())
}

/// When [`refuse_recording`] asks the driver whether the stream is capturing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StatusCheck {
    /// Every time (one driver call): for paths whose own cost dwarfs it (`cuLaunchHostFunc`),
    /// and which must refuse captures begun outside cuweave too.
    Always,
    /// Only while a capture begun through cuweave is active (one atomic load otherwise): for
    /// hot paths.
    WhileCuweaveCaptures,
}

/// The calling thread switched to another capture mode for a scope; the previous mode comes
/// back on drop (`cuThreadExchangeStreamCaptureMode`).
///
/// Relaxed mode is how a library makes a call it knows to be safe (an allocation that the
/// capture does not record) while a capture is active.
#[must_use = "the previous mode comes back when the guard is dropped"]
#[derive(Debug)]
pub struct CaptureModeGuard {
    previous: sys::CUstreamCaptureMode,
    /// Thread-bound: the mode is per thread.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl CaptureModeGuard {
    /// Puts this thread in `mode` until the guard is dropped.
    ///
    /// # Errors
    /// The driver's error (`Unsupported` before CUDA 10.1).
    pub fn enter(mode: CaptureMode) -> Result<Self> {
        let api = driver()?;
        let mut previous = mode.to_sys();
        // SAFETY: valid in-out pointer.
        unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut previous)) }?;
        Ok(Self {
            previous,
            _not_send: std::marker::PhantomData,
        })
    }

    /// The mode the thread was in before.
    pub fn previous(&self) -> CaptureMode {
        CaptureMode::from_sys(self.previous)
    }
}

impl Drop for CaptureModeGuard {
    fn drop(&mut self) {
        let Ok(api) = driver() else { return };
        let mut mode = self.previous;
        // SAFETY: valid in-out pointer.
        if let Err(error) = unsafe { cu!(api.thread_exchange_stream_capture_mode(&mut mode)) } {
            tracing::warn!(%error, "restoring the thread's capture mode failed");
        }
    }
}

/// Whether `raw` is the legacy default stream (null or `CU_STREAM_LEGACY`).
fn is_legacy_default(raw: sys::CUstream) -> bool {
    raw as usize <= 1
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
    /// [`GraphError::AlreadyCapturing`] when a cuweave capture is active on this stream; the
    /// driver's error otherwise.
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
    /// When another capture is already active the context cannot be synchronised (that would
    /// wait on, or break, the capturing streams): the capture begins without it and inherits the
    /// bound of an active capture of the same context, if any.
    ///
    /// # Errors
    /// As [`begin_capture`](Self::begin_capture), and the synchronisation's error (a kernel that
    /// faulted earlier, ...), in which case no capture is begun.
    pub fn begin_capture_synchronized(&self, mode: CaptureMode) -> Result<()> {
        self.check_can_capture()?;
        let mut complete_before = self.inherited_complete_before();
        if active_captures() == 0 {
            let epoch = CaptureState::from_word(STATE.fetch_add(1 << COUNT_BITS, Ordering::SeqCst))
                .epoch
                + 1;
            // No capture can begin between the count's check and the synchronisation, which
            // would invalidate it.
            match while_no_capture_begins(|| self.context().synchronize()) {
                Ok(()) => complete_before = complete_before.max(epoch),
                // Another thread began a capture meanwhile: begin without the synchronisation.
                Err(DriverError::Graph(GraphError::Capturing { .. })) => {}
                Err(error) => return Err(error),
            }
        }
        self.begin_capture_recorded(mode, complete_before)
    }

    fn check_can_capture(&self) -> Result<()> {
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
        self.context().bind_to_thread()?;
        let api = driver()?;
        // Until the capture is counted: see `while_no_capture_begins`.
        let _beginning = CAPTURE_BEGIN.write();
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
        });
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
        STATE.fetch_sub(1, Ordering::AcqRel);
        if record.mode == CaptureMode::Global {
            GLOBAL.fetch_sub(1, Ordering::AcqRel);
        }
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

    /// Whether this stream is capturing, and into which capture sequence.
    /// `cuStreamGetCaptureInfo` (the `_v3` form where the driver has it, else `_v2`).
    pub fn capture_status(&self) -> Result<CaptureStatus> {
        self.bind_if_context_relative()?;
        let api = driver()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id = 0u64;
        if api.stream_get_capture_info_v3.is_available() {
            // SAFETY: live stream; valid out-pointers; the optional outputs are null.
            unsafe {
                cu!(api.stream_get_capture_info_v3(
                    self.as_raw(),
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ))
            }?;
        } else {
            // SAFETY: as above, for the older signature.
            unsafe {
                cu!(api.stream_get_capture_info_v2(
                    self.as_raw(),
                    &mut status,
                    &mut id,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                ))
            }?;
        }
        Ok(match status {
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE => {
                CaptureStatus::Active { id }
            }
            sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_INVALIDATED => {
                CaptureStatus::Invalidated { id }
            }
            _ => CaptureStatus::None,
        })
    }

    /// Whether this stream is capturing (`cuStreamIsCapturing`).
    pub fn is_capturing(&self) -> Result<bool> {
        self.bind_if_context_relative()?;
        let api = driver()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: live stream; valid out-pointer.
        unsafe { cu!(api.stream_is_capturing(self.as_raw(), &mut status)) }?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Makes the stream's context current when the handle is one of the driver's
    /// context-relative names (null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`), which the
    /// driver resolves against the calling thread's current context: on a thread with none,
    /// or with another context current, the status would be refused or another context's.
    /// Streams this crate created name their own context and skip it.
    fn bind_if_context_relative(&self) -> Result<()> {
        if self.is_special_handle() {
            self.context().bind_to_thread()?;
        }
        Ok(())
    }

    /// The mode of the capture begun on this stream through cuweave, if any.
    pub fn capture_mode(&self) -> Option<CaptureMode> {
        RECORDS
            .lock()
            .iter()
            .find(|record| record.stream == self.id())
            .map(|record| record.mode)
    }
}

fn invalidated_since(start: u64, thread: Option<std::thread::ThreadId>) -> DriverError {
    let first = first_failure_after(start, thread);
    GraphError::CaptureInvalidated {
        broken_by: first.map(|failure| failure.operation),
        code_name: first.map(|failure| capture_error_name(failure.code)),
    }
    .into()
}

/// Held by the unit tests that raise the capture count by hand, and by those that need it at
/// zero: the test harness runs them on parallel threads.
#[cfg(test)]
pub(crate) static CAPTURE_COUNT_TEST_LOCK: Mutex<()> = Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failure_log_is_bounded_and_finds_the_first_after_a_point() {
        let _count = CAPTURE_COUNT_TEST_LOCK.lock();
        // Not noted while no capture is active (the other tests that touch the count hold the
        // lock too).
        let before = FAILURE_SEQ.load(Ordering::Acquire);
        note_driver_failure(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "cuTest",
        );
        assert_eq!(FAILURE_SEQ.load(Ordering::Acquire), before);
        STATE.fetch_add(1, Ordering::AcqRel);
        let start = FAILURE_SEQ.load(Ordering::Acquire);
        note_driver_failure(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "cuIgnored");
        // A consequence, not a cause: never noted.
        note_driver_failure(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
            "cuConsequence",
        );
        for _ in 0..100_000 {
            note_driver_failure(
                sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                "cuLater",
            );
        }
        STATE.fetch_sub(1, Ordering::AcqRel);
        assert!(FAILURES.lock().len() <= FAILURE_LOG);
        // With no capture recorded, nobody asks about old failures: the log keeps the newest.
        assert!(first_failure_after(start, None).is_some_and(|first| first.operation == "cuLater"));
        let last = FAILURE_SEQ.load(Ordering::Acquire);
        assert!(first_failure_after(last, None).is_none());
    }

    #[test]
    fn a_capture_looks_first_at_its_own_threads_failures() {
        let _count = CAPTURE_COUNT_TEST_LOCK.lock();
        let here = std::thread::current().id();
        let other = std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap();
        // Another thread broke its capture first, then this one broke its own.
        let start = FAILURE_SEQ.fetch_add(2, Ordering::AcqRel);
        {
            let mut failures = FAILURES.lock();
            failures.clear();
            for (seq, operation, thread) in [
                (start + 1, "cuOtherThread", other),
                (start + 2, "cuThisThread", here),
            ] {
                failures.push_back(Failure {
                    seq,
                    operation,
                    code: sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                    thread,
                });
            }
        }
        let operation = |thread| first_failure_after(start, thread).map(|f| f.operation);
        assert_eq!(operation(Some(here)), Some("cuThisThread"));
        assert_eq!(operation(Some(other)), Some("cuOtherThread"));
        // A global capture (no thread) is broken by the first failure anywhere; a thread with
        // no failure of its own is given that one too.
        assert_eq!(operation(None), Some("cuOtherThread"));
        let third = std::thread::spawn(|| std::thread::current().id())
            .join()
            .unwrap();
        assert_eq!(operation(Some(third)), Some("cuOtherThread"));
        FAILURES.lock().clear();
    }

    #[test]
    fn the_state_word_holds_the_count_below_the_epoch() {
        let word = (7u64 << COUNT_BITS) | 3;
        assert_eq!(
            CaptureState::from_word(word),
            CaptureState {
                active: 3,
                epoch: 7
            }
        );
        // A bump of the epoch never touches the count, nor a count change the epoch.
        let bumped = CaptureState::from_word(word + (1 << COUNT_BITS) - 1);
        assert_eq!((bumped.active, bumped.epoch), (2, 8));
        assert!(!capture_is_active(u64::MAX));
    }

    #[test]
    fn status_helpers() {
        assert!(!CaptureStatus::None.is_capturing());
        assert!(CaptureStatus::Active { id: 3 }.is_capturing());
        assert_eq!(CaptureStatus::Invalidated { id: 4 }.id(), Some(4));
        assert!(is_legacy_default(std::ptr::null_mut()));
        assert!(is_legacy_default(1 as sys::CUstream));
        assert!(!is_legacy_default(2 as sys::CUstream));
    }

    #[test]
    fn no_capture_means_nothing_is_refused() {
        let _count = CAPTURE_COUNT_TEST_LOCK.lock();
        // No unit test of this crate begins a real capture.
        assert_eq!(active_captures(), 0);
        assert!(refuse_while_capturing(None, "op").is_ok());
    }
}
