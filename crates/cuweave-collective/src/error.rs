//! [`CollectiveError`]: every way a collective, a communicator or loading NCCL can fail.

use std::time::Duration;

use crate::loader::NcclVersion;
use crate::sys;

/// The result type of this crate.
pub type Result<T, E = CollectiveError> = std::result::Result<T, E>;

/// An `ncclResult_t` other than `ncclSuccess`, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NcclCode {
    /// `ncclUnhandledCudaError`: a CUDA call inside NCCL failed.
    UnhandledCudaError,
    /// `ncclSystemError`: a system call (socket, shared memory, …) failed.
    SystemError,
    /// `ncclInternalError`: a bug in NCCL, or memory corruption.
    InternalError,
    /// `ncclInvalidArgument`: a bad argument (pointer, count, root, type).
    InvalidArgument,
    /// `ncclInvalidUsage`: a correct call in the wrong situation (two ranks on one GPU, …).
    InvalidUsage,
    /// `ncclRemoteError`: a peer failed or went away.
    RemoteError,
    /// `ncclInProgress`: a non-blocking operation has not finished yet.
    InProgress,
    /// `ncclTimeout`: NCCL's own timeout (a network operation).
    Timeout,
    /// A code this version of cuweave does not know.
    Other(u32),
}

impl NcclCode {
    /// The code for a raw `ncclResult_t` (`None` for `ncclSuccess`).
    pub fn from_raw(code: sys::ncclResult_t) -> Option<Self> {
        Some(match code {
            sys::ncclResult_t::ncclSuccess => return None,
            sys::ncclResult_t::ncclUnhandledCudaError => Self::UnhandledCudaError,
            sys::ncclResult_t::ncclSystemError => Self::SystemError,
            sys::ncclResult_t::ncclInternalError => Self::InternalError,
            sys::ncclResult_t::ncclInvalidArgument => Self::InvalidArgument,
            sys::ncclResult_t::ncclInvalidUsage => Self::InvalidUsage,
            sys::ncclResult_t::ncclRemoteError => Self::RemoteError,
            sys::ncclResult_t::ncclInProgress => Self::InProgress,
            sys::ncclResult_t::ncclTimeout => Self::Timeout,
            other => Self::Other(other.0),
        })
    }

    /// NCCL's name for the code, e.g. `ncclInvalidUsage`.
    pub fn name(self) -> &'static str {
        match self {
            Self::UnhandledCudaError => "ncclUnhandledCudaError",
            Self::SystemError => "ncclSystemError",
            Self::InternalError => "ncclInternalError",
            Self::InvalidArgument => "ncclInvalidArgument",
            Self::InvalidUsage => "ncclInvalidUsage",
            Self::RemoteError => "ncclRemoteError",
            Self::InProgress => "ncclInProgress",
            Self::Timeout => "ncclTimeout",
            Self::Other(_) => "ncclResult_t",
        }
    }
}

impl std::fmt::Display for NcclCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Other(code) => write!(f, "ncclResult_t {code}"),
            known => f.write_str(known.name()),
        }
    }
}

/// Every way this crate fails.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// No NCCL library could be loaded.
    #[error("no NCCL library found: tried {} ({reason})", tried.join(", "))]
    NotFound {
        /// Every name and path tried, in order.
        tried: Vec<String>,
        /// What the last attempt reported.
        reason: String,
    },
    /// The loaded NCCL does not export an entry point this operation needs.
    #[error("the loaded NCCL does not provide `{symbol}` (too old?)")]
    Unsupported {
        /// The missing symbol.
        symbol: &'static str,
    },
    /// An NCCL call failed.
    #[error(
        "{operation} failed: {code}: {description}{}",
        last_error_suffix(last_error)
    )]
    Nccl {
        /// The code NCCL returned (or reported through `ncclCommGetAsyncError`).
        code: NcclCode,
        /// `ncclGetErrorString`'s text for the code.
        description: String,
        /// `ncclGetLastError`'s text: NCCL's last warning on this thread or communicator.
        last_error: String,
        /// The call or step that failed.
        operation: &'static str,
    },
    /// A collective or an initialisation did not finish before its deadline (a peer that
    /// never arrived, or one that died): the communicator was aborted.
    #[error("{operation} did not complete within {waited:?}; the communicator was aborted")]
    Timeout {
        /// What was waited for.
        operation: &'static str,
        /// How long.
        waited: Duration,
    },
    /// The communicator was aborted earlier (after a timeout or an asynchronous error), so it
    /// takes no more work.
    #[error("{operation}: the communicator was aborted")]
    Aborted {
        /// The refused call.
        operation: &'static str,
    },
    /// A bad argument, refused before reaching NCCL.
    #[error("{operation}: {reason}")]
    InvalidArgument {
        /// The refused call.
        operation: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A [`CommConfig`](crate::CommConfig) field out of its valid range, refused before NCCL
    /// is called.
    #[error("CommConfig::{field} = {value}: {reason}")]
    InvalidConfig {
        /// The field, as `CommConfig` names it (`min_ctas`, `comm_name`, …).
        field: &'static str,
        /// The value given, as Rust's `Debug` writes it.
        value: String,
        /// The valid range, or what is wrong.
        reason: String,
    },
    /// A [`CommConfig`](crate::CommConfig) field set that the loaded NCCL is older than: its
    /// `ncclConfig_t` ends before the field, so it would ignore the value without a word.
    #[error("CommConfig::{field} needs NCCL {needs} or newer; the loaded NCCL is {loaded}")]
    ConfigUnsupported {
        /// The field, as `CommConfig` names it.
        field: &'static str,
        /// The first release whose `ncclConfig_t` has the field.
        needs: NcclVersion,
        /// The loaded release.
        loaded: NcclVersion,
    },
    /// The driver layer failed.
    #[error(transparent)]
    Driver(#[from] cuweave_driver::DriverError),
    /// A buffer operation (use tracking) failed.
    #[error(transparent)]
    Memory(#[from] cuweave_memory::MemoryError),
    /// The event layer (coordinator, waiter) failed.
    #[error(transparent)]
    Event(#[from] cuweave_event::EventError),
}

fn last_error_suffix(last_error: &str) -> String {
    if last_error.is_empty() {
        String::new()
    } else {
        format!(" (last NCCL warning: {last_error})")
    }
}

impl CollectiveError {
    /// Whether no NCCL library is installed (as opposed to one that failed).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// Whether the call was refused because a stream capture is active (a collective or wait
    /// on a capturing stream, a blocking call a capture forbids), from whichever layer refused
    /// it: nothing was queued, and the call may be made again once the capture has ended.
    pub fn is_capture_refusal(&self) -> bool {
        match self {
            Self::Driver(error) => error.is_capture_refusal(),
            Self::Memory(error) => error.is_capture_refusal(),
            Self::Event(error) => error.is_capture_refusal(),
            _ => false,
        }
    }

    /// Whether this is a timeout that aborted the communicator.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Timeout { .. })
    }

    /// The NCCL code, when NCCL returned one.
    pub fn nccl_code(&self) -> Option<NcclCode> {
        match self {
            Self::Nccl { code, .. } => Some(*code),
            _ => None,
        }
    }

    pub(crate) fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            operation,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod capture_refusal_tests {
    use cuweave_driver::{DriverError, GraphError};

    use super::CollectiveError;

    #[test]
    fn capture_refusals_are_seen_through_every_wrapped_layer() {
        let refused = || -> DriverError {
            GraphError::Capturing {
                operation: "Stream::synchronize",
                reason: "test",
            }
            .into()
        };
        assert!(CollectiveError::Driver(refused()).is_capture_refusal());
        assert!(
            CollectiveError::Memory(cuweave_memory::MemoryError::Driver(refused()))
                .is_capture_refusal()
        );
        assert!(
            CollectiveError::Event(cuweave_event::EventError::Driver(refused()))
                .is_capture_refusal()
        );
        assert!(
            !CollectiveError::Driver(DriverError::InvalidArgument {
                operation: "x",
                reason: "y".into()
            })
            .is_capture_refusal()
        );
    }
}
