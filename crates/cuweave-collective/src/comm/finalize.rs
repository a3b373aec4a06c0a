//! Ending a rank: `ncclCommFinalize` then `ncclCommDestroy`, on request or on drop.

use std::sync::Arc;

use crate::error::{CollectiveError, NcclCode, Result};
use crate::raw;

use super::{CommInner, Communicator, abort_raw, settle_raw};

impl CommInner {
    /// `ncclCommFinalize` (waiting, within the deadline, for the rank's queued work), then
    /// `ncclCommDestroy`; when finalising fails or times out the handle is aborted instead.
    /// `Aborted` (and nothing done) once the handle is gone.
    fn close(&mut self) -> Result<()> {
        const OP: &str = "ncclCommFinalize";
        let Some(raw) = self.handle.take() else {
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
        settle_raw(api, &[&self.context], &[raw], OP, self.config.timeout)?;
        let code = raw::destroy(api, raw)?;
        api.check(code, "ncclCommDestroy", std::ptr::null_mut())
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
    /// NCCL's error, or `Timeout` when the queued work does not finish in time (the
    /// communicator is then aborted).
    ///
    /// [`CommConfig::timeout`]: super::CommConfig::timeout
    pub fn finalize(self) -> Result<()> {
        const OP: &str = "Communicator::finalize";
        if self.is_aborted() {
            // Nothing to finalise, whoever still holds a clone (a background abort does until
            // its `ncclCommAbort` returns).
            return Err(CollectiveError::Aborted { operation: OP });
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
        match self.close() {
            Ok(()) | Err(CollectiveError::Aborted { .. }) => {}
            Err(error) => {
                tracing::error!(%error, "finalising or destroying an NCCL communicator failed");
            }
        }
    }
}
