//! The driver calls that broke a capture: remembered (a bounded log) while a capture is active,
//! so that the capture's end, and every call made on it before that, report one
//! [`GraphError::CaptureInvalidated`] naming the first of them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::registry::{RECORDS, active_captures};
use crate::error::DriverError;
use crate::graph::error::{GraphError, capture_error_name, is_capture_code};
use crate::sys;

/// Sequence number of driver failures with a capture error code.
pub(super) static FAILURE_SEQ: AtomicU64 = AtomicU64::new(0);
/// How many capture failures [`FAILURES`] remembers; older ones are dropped.
pub(super) const FAILURE_LOG: usize = 64;

/// A driver call that failed with a capture error while a capture was active.
#[derive(Debug, Clone, Copy)]
pub(super) struct Failure {
    pub(super) seq: u64,
    pub(super) operation: &'static str,
    pub(super) code: sys::CUresult,
    /// The thread that made the call: a thread-local capture is broken by its own thread's
    /// calls, so its end looks there first.
    pub(super) thread: std::thread::ThreadId,
}

/// The most recent capture failures, oldest first (bounded by [`FAILURE_LOG`]).
pub(super) static FAILURES: Mutex<VecDeque<Failure>> = Mutex::new(VecDeque::new());

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
pub(super) fn first_failure_after(
    after: u64,
    thread: Option<std::thread::ThreadId>,
) -> Option<Failure> {
    let failures = FAILURES.lock();
    let mut since = failures.iter().filter(|failure| failure.seq > after);
    let first = since.clone().next().copied();
    thread
        .and_then(|thread| since.find(|failure| failure.thread == thread).copied())
        .or(first)
}

pub(super) fn invalidated_since(start: u64, thread: Option<std::thread::ThreadId>) -> DriverError {
    let first = first_failure_after(start, thread);
    GraphError::CaptureInvalidated {
        broken_by: first.map(|failure| failure.operation),
        code_name: first.map(|failure| capture_error_name(failure.code)),
    }
    .into()
}
