//! [`TransferError`]: what can go wrong moving bytes.

use cuweave_driver::DriverError;
use cuweave_memory::MemoryError;

use crate::method::TransferMethod;
use crate::staging::StagingConfig;

/// A result whose error is a [`TransferError`].
pub type Result<T, E = TransferError> = std::result::Result<T, E>;

/// Why a transfer (or planning, calibration, or loading a calibration) failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The memory layer failed (bad buffer range, busy buffer, or the driver below it).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The driver failed directly (peer access, streams, device queries).
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// An offset and length run past the end of one side of a transfer.
    #[error("{side}: range {offset}..{offset}+{len} is outside {capacity} elements")]
    OutOfRange {
        /// Which side: `"source"` or `"destination"`.
        side: &'static str,
        /// Start of the requested range, in elements.
        offset: usize,
        /// Length of the requested range, in elements.
        len: usize,
        /// Elements on that side.
        capacity: usize,
    },
    /// The two sides of a transfer differ in length.
    #[error("source has {source_len} elements but destination {destination_len}")]
    LengthMismatch {
        /// Elements in the source.
        source_len: usize,
        /// Elements in the destination.
        destination_len: usize,
    },
    /// A method was asked for (or forced) on a path it cannot serve on this machine.
    #[error("{method} cannot move {path}: {reason}")]
    Unsupported {
        /// The method asked for.
        method: TransferMethod,
        /// The path, as `source -> destination`.
        path: String,
        /// Why not (missing capability, wrong device, ...).
        reason: String,
    },
    /// The event layer failed while an async transfer waited (driver error, dead context,
    /// waiter shut down).
    #[error(transparent)]
    Event(#[from] cuweave_event::EventError),
    /// Reading or writing a calibration file failed.
    #[error("calibration file {path}: {message}")]
    CalibrationFile {
        /// The file.
        path: String,
        /// The I/O or JSON error.
        message: String,
    },
    /// A device ordinal the manager does not serve.
    #[error("device {device} does not exist (the manager serves {count} devices)")]
    NoSuchDevice {
        /// The ordinal asked for.
        device: usize,
        /// How many devices the manager serves.
        count: usize,
    },
    /// Host registration was asked for a slice with no bytes in it.
    #[error("cannot register an empty host slice ({len} elements of {element_bytes} bytes)")]
    EmptyRegistration {
        /// Elements in the slice.
        len: usize,
        /// Bytes per element.
        element_bytes: usize,
    },
    /// A staging configuration (given to `with_staging` or read from a calibration file) that
    /// cannot run.
    #[error("staging configuration {config:?} cannot run: {reason}")]
    InvalidStaging {
        /// The configuration.
        config: StagingConfig,
        /// Which bound it breaks.
        reason: &'static str,
    },
    /// A worker thread of a pipelined copy panicked (a bug; the copy did not complete).
    #[error("a staging worker thread panicked")]
    WorkerPanicked,
    /// An [`AsyncTransfer`](crate::AsyncTransfer) was polled again after it completed: its
    /// result was handed out by the poll that completed it, and nothing more is copied.
    #[error("the {path} transfer was already polled to completion")]
    AlreadyCompleted {
        /// The transfer's path.
        path: String,
    },
}

impl<H> From<cuweave_memory::HostCopyError<H>> for TransferError {
    /// The memory layer's error of a refused or failed copy, its host side dropped (the
    /// transfer's own staging blocks go back to their pool).
    fn from(error: cuweave_memory::HostCopyError<H>) -> Self {
        error.into_error().into()
    }
}

impl TransferError {
    /// Whether the transfer was refused because a stream capture is active, from whichever
    /// layer refused it: nothing was moved, and it may be made again once the capture has ended.
    pub fn is_capture_refusal(&self) -> bool {
        match self {
            Self::Driver(error) => error.is_capture_refusal(),
            Self::Memory(error) => error.is_capture_refusal(),
            Self::Event(error) => error.is_capture_refusal(),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use cuweave_driver::{DriverError, GraphError};

    use super::*;

    #[test]
    fn capture_refusals_are_seen_through_every_wrapped_layer() {
        let refused = || -> DriverError {
            GraphError::Capturing {
                operation: "Stream::synchronize",
                reason: "test",
            }
            .into()
        };
        assert!(TransferError::Driver(refused()).is_capture_refusal());
        assert!(TransferError::Memory(MemoryError::Driver(refused())).is_capture_refusal());
        assert!(
            TransferError::Event(cuweave_event::EventError::Driver(refused())).is_capture_refusal()
        );
        assert!(
            !TransferError::Memory(MemoryError::ZeroLength { operation: "x" }).is_capture_refusal()
        );
        assert!(
            !TransferError::Driver(DriverError::InvalidArgument {
                operation: "x",
                reason: "y".into()
            })
            .is_capture_refusal()
        );
    }
}
