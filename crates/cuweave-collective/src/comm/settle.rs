//! Settling: polling `ncclCommGetAsyncError` until non-blocking work is no longer in
//! progress, within the deadline.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::Context;

use crate::error::{CollectiveError, NcclCode, Result};
use crate::handle::{Polled, poll_until};
use crate::loader::NcclApi;
use crate::raw::{self, RawComm};

use super::{Communicator, abort_raw_together};

/// Polls `ncclCommGetAsyncError` on every handle until none is in progress. Any failure (an
/// asynchronous error, the deadline, a failed poll) aborts every non-null handle before it is
/// returned, so a caller never aborts them again. For handles no other thread can reach yet
/// (initialisation, a split's children, finalisation on drop).
pub(crate) fn settle_raw(
    api: &NcclApi,
    contexts: &[&Arc<Context>],
    handles: &[RawComm],
    operation: &'static str,
    timeout: Duration,
) -> Result<()> {
    let polled = poll_until(
        Instant::now(),
        timeout,
        || {
            let mut state = Polled::Done;
            for (raw, context) in handles.iter().zip(contexts) {
                if !raw.is_null() && settle_once(api, context, *raw, operation)? == Polled::Pending
                {
                    state = Polled::Pending;
                }
            }
            Ok(state)
        },
        |waited| CollectiveError::Timeout { operation, waited },
    );
    if polled.is_err() {
        abort_raw_together(
            api,
            contexts
                .iter()
                .map(|context| &***context)
                .zip(handles.iter().copied()),
        );
    }
    polled
}

/// One poll of `ncclCommGetAsyncError` on a handle the caller may use: idle, in progress, or
/// NCCL's error (nothing is aborted here).
pub(crate) fn settle_once(
    api: &NcclApi,
    context: &Context,
    raw: RawComm,
    operation: &'static str,
) -> Result<Polled> {
    context.bind_to_thread()?;
    let state = raw::async_error(api, raw)?;
    match NcclCode::from_raw(state) {
        None => Ok(Polled::Done),
        Some(NcclCode::InProgress) => Ok(Polled::Pending),
        Some(kind) => Err(api.error(kind, state, operation, raw.0)),
    }
}

impl Communicator {
    /// `ncclCommGetAsyncError`: `Ok(())` while healthy (or still busy with a non-blocking
    /// call), NCCL's error once one happened. An error aborts the communicator: it is marked
    /// aborted before this returns, and `ncclCommAbort` runs in the background, so the caller
    /// is not held while queued device work drains.
    ///
    /// Callable from any thread, without waiting for a call in progress on another.
    ///
    /// # Errors
    /// `Aborted`; NCCL's asynchronous error.
    pub fn check_async_error(&self) -> Result<()> {
        const OP: &str = "ncclCommGetAsyncError";
        match self.poll(OP) {
            Ok(_) => Ok(()),
            Err(error @ CollectiveError::Aborted { .. }) => Err(error),
            Err(error) => {
                self.abort_in_background();
                Err(error)
            }
        }
    }

    /// One poll of `ncclCommGetAsyncError` under a fresh guard (nothing is aborted here).
    pub(crate) fn poll(&self, operation: &'static str) -> Result<Polled> {
        let guard = self.enter(operation)?;
        guard
            .call(|raw| settle_once(self.inner.api, &self.inner.context, raw, operation))
            .unwrap_or(Err(CollectiveError::Aborted { operation }))
    }

    /// Polls until the communicator's non-blocking work is no longer in progress, within the
    /// deadline counted from `started`. NCCL's error, a failed poll or the deadline aborts the
    /// communicator, in the background (see [`abort_in_background`]: a timed-out caller is not
    /// held while queued device work drains); an abort from another thread ends the wait at
    /// the next poll with `Aborted`. No guard is held between polls.
    ///
    /// [`abort_in_background`]: Self::abort_in_background
    pub(crate) fn settle(&self, operation: &'static str, started: Instant) -> Result<()> {
        let settled = self.settle_without_abort(operation, started);
        if let Err(error) = &settled
            && !matches!(error, CollectiveError::Aborted { .. })
        {
            self.abort_in_background();
        }
        settled
    }

    /// As [`settle`](Self::settle), but a failure aborts nothing: for a group, whose
    /// communicators must be aborted together ([`abort_together`](super::abort::abort_together)).
    pub(crate) fn settle_without_abort(
        &self,
        operation: &'static str,
        started: Instant,
    ) -> Result<()> {
        poll_until(
            started,
            self.inner.config.timeout,
            || self.poll(operation),
            |waited| CollectiveError::Timeout { operation, waited },
        )
    }
}
