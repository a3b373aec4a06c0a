//! Ending a rank: `ncclCommFinalize` then `ncclCommDestroy`, on request or on drop.

use std::sync::Arc;
use std::time::Duration;

use cuweave_driver::Context;

use crate::error::{CollectiveError, NcclCode, Result};
use crate::loader::NcclApi;
use crate::raw::{self, HandleSlot, RawComm};

use super::{CommInner, Communicator, abort_raw, settle_raw};

impl CommInner {
    /// `ncclCommFinalize` (waiting, within the deadline, for the rank's queued work), then
    /// `ncclCommDestroy`; when finalising fails or times out the handle is aborted instead.
    /// `Aborted` (and nothing done) once the handle is gone.
    fn close(&mut self) -> Result<()> {
        self.take_for_close().close()
    }

    /// The handle and what closing it needs, taken out of the rank (which is then closed).
    fn take_for_close(&mut self) -> Closing {
        Closing {
            raw: self.handle.take(),
            slot: self.slot.take(),
            api: self.api,
            context: Arc::clone(&self.context),
            timeout: self.config.timeout,
        }
    }
}

/// A rank's handle on its way to `ncclCommFinalize` and `ncclCommDestroy`.
struct Closing {
    raw: Option<RawComm>,
    slot: Option<HandleSlot>,
    api: &'static NcclApi,
    context: Arc<Context>,
    timeout: Duration,
}

impl Closing {
    fn close(mut self) -> Result<()> {
        const OP: &str = "ncclCommFinalize";
        let Some(raw) = self.raw.take() else {
            // Aborted: NCCL's thread may have been cut short with the slot's address in hand.
            if let Some(slot) = self.slot.take() {
                slot.leak();
            }
            return Err(CollectiveError::Aborted { operation: OP });
        };
        // Initialised, so NCCL writes the slot no more: it is freed when this returns, and a
        // second close (a drop after `finalize`) finds neither handle nor slot.
        let _slot = self.slot.take();
        let api = self.api;
        let started = self
            .context
            .bind_to_thread()
            .map_err(CollectiveError::from)
            .and_then(|()| raw::finalize(api, raw))
            .and_then(|code| match NcclCode::from_raw(code) {
                None | Some(NcclCode::InProgress) => Ok(()),
                Some(kind) => Err(api.error(kind, code, OP, raw.0)),
            });
        if let Err(error) = started {
            abort_raw(api, &self.context, raw);
            return Err(error);
        }
        // Waits for the rank's queued work; on failure the handle is already aborted.
        settle_raw(api, &[&self.context], &[raw], OP, self.timeout)?;
        let code = raw::destroy(api, raw)?;
        api.check(code, "ncclCommDestroy", std::ptr::null_mut())
    }

    /// Closes on a thread of its own once no global-mode capture is active (woken when each
    /// capture ends; at most [`DEFERRED_CLOSE_LIMIT`], then closed anyway): the last clone of
    /// a communicator dropped while another thread captures in global mode. NCCL's teardown
    /// frees and synchronises on threads of its own, beyond relaxed capture mode, which would
    /// break the capture.
    fn close_after_global_captures(self) {
        let spawned = std::thread::Builder::new()
            .name("cuweave-nccl-close".into())
            .spawn(move || {
                if !cuweave_driver::graph::wait_for_no_global_capture(DEFERRED_CLOSE_LIMIT) {
                    tracing::warn!("a global capture outlived the wait to close an NCCL communicator; closing it anyway");
                }
                log_close(self.close());
            });
        if let Err(error) = spawned {
            tracing::error!(%error, "no thread to close an NCCL communicator after a capture; its handle is leaked");
        }
    }
}

/// How long a dropped communicator waits for global captures to end before closing anyway.
const DEFERRED_CLOSE_LIMIT: Duration = Duration::from_secs(600);

/// Whether a capture begun through cuweave forbids NCCL's teardown now on this thread (a
/// global-mode capture anywhere, or a capture of this thread).
fn global_captures_forbid_teardown() -> bool {
    cuweave_driver::graph::refuse_while_capturing(None, "Communicator (drop)").is_err()
}

fn log_close(closed: Result<()>) {
    match closed {
        Ok(()) | Err(CollectiveError::Aborted { .. }) => {}
        Err(error) => {
            tracing::error!(%error, "finalising or destroying an NCCL communicator failed");
        }
    }
}

impl Communicator {
    /// Finalises and destroys the rank now, and says how that went, where dropping the last
    /// clone does the same but can only log a failure: `ncclCommFinalize` (waiting, within
    /// [`CommConfig::timeout`], for the rank's queued work), then `ncclCommDestroy`, as an NCCL
    /// program ends its communicators and torch's `destroy_process_group` does.
    ///
    /// The rank is shared by its clones (and by pending [`completion`](Self::completion)
    /// futures), so only the last one can finalise it: while others are alive this clone is
    /// dropped and the call is `InvalidArgument`; the last clone to go finalises on drop.
    ///
    /// # Errors
    /// `InvalidArgument` while other clones are alive; `Aborted` for an aborted communicator;
    /// `GraphError::Capturing` (through [`CollectiveError::is_capture_refusal`]) while a
    /// global-mode capture is active on any thread, or any capture on this one: NCCL's
    /// teardown runs partly on threads of its own, beyond relaxed capture mode, and would break
    /// it; the rank is then finalised on a thread of its own once no global capture is active,
    /// as a drop then does. NCCL's error, or `Timeout` when the queued work does not finish in
    /// time (the communicator is then aborted).
    ///
    /// [`CommConfig::timeout`]: super::CommConfig::timeout
    pub fn finalize(self) -> Result<()> {
        const OP: &str = "Communicator::finalize";
        if self.is_aborted() {
            // Nothing to finalise, whoever still holds a clone (a background abort does until
            // its `ncclCommAbort` returns).
            return Err(CollectiveError::Aborted { operation: OP });
        }
        if global_captures_forbid_teardown() {
            // `self` drops here; if it is the last clone its drop finalises the rank on a thread
            // of its own once no global capture is active.
            return Err(cuweave_driver::DriverError::from(
                cuweave_driver::GraphError::Capturing {
                    operation: OP,
                    reason: "a global-mode capture is active: NCCL's teardown, on threads of its own, would break it; the last clone is finalised once no global capture is active",
                },
            )
            .into());
        }
        let clones = Arc::strong_count(&self.inner) - 1;
        match Arc::try_unwrap(self.inner) {
            Ok(mut inner) => inner.close(),
            Err(_shared) => Err(CollectiveError::invalid(
                OP,
                format!("{clones} other clones of the communicator (or its futures) are alive"),
            )),
        }
    }
}

impl Drop for CommInner {
    fn drop(&mut self) {
        let closing = self.take_for_close();
        if closing.raw.is_some() && global_captures_forbid_teardown() {
            closing.close_after_global_captures();
            return;
        }
        log_close(closing.close());
    }
}
