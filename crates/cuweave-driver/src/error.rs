//! [`DriverError`]: every way a driver call can fail, with the driver's own words for it.
//!
//! A failed driver call is stored as its code and operation only (no allocation, no further
//! driver call), so polling calls that answer `CUDA_ERROR_NOT_READY` stay as cheap as the raw
//! call. The driver's name and description of the code are looked up when asked for
//! ([`DriverError::name`], [`DriverError::description`]) or when the error is displayed.

use std::borrow::Cow;

use crate::sys;

/// A result whose error is a [`DriverError`].
pub type Result<T, E = DriverError> = std::result::Result<T, E>;

/// Why a driver operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// No CUDA driver library could be loaded on this machine.
    #[error("no CUDA driver found: looked for {searched} ({reason})")]
    NotFound {
        /// The library names tried, in order.
        searched: String,
        /// What the last attempt reported.
        reason: String,
    },
    /// The loaded driver does not export an entry point this operation needs.
    #[error("the CUDA driver does not provide `{symbol}` (driver too old?)")]
    Unsupported {
        /// The missing symbol.
        symbol: &'static str,
    },
    /// A driver call returned an error code. The driver's name and description of the code
    /// ([`name`](Self::name), [`description`](Self::description)) are looked up lazily.
    #[error(
        "{operation} failed: {} ({code}): {}",
        cuda_name(*code),
        cuda_description(*code)
    )]
    Cuda {
        /// The raw `CUresult` value.
        code: u32,
        /// The driver entry point that failed.
        operation: &'static str,
    },
    /// The driver refused to load a module (PTX that does not JIT-compile, an image for
    /// another architecture): the code as in [`Cuda`](Self::Cuda), plus what the JIT compiler
    /// wrote to its error log (then its info log), bounded and trimmed; empty when it wrote
    /// nothing, as for most cubin and fatbin failures.
    #[error(
        "{operation} failed: {} ({code}): {}{}",
        cuda_name(*code),
        cuda_description(*code),
        jit_log_suffix(log)
    )]
    ModuleLoad {
        /// The raw `CUresult` value, e.g. `CUDA_ERROR_INVALID_PTX` (218).
        code: u32,
        /// The driver entry point that failed (`cuModuleLoadDataEx`).
        operation: &'static str,
        /// The JIT compiler's log, e.g. `ptxas application ptx input, line 7; error   : …`.
        log: String,
    },
    /// The device lacks a capability the operation needs (managed memory, memory pools, …).
    #[error("device {device} lacks {capability}, which {operation} needs")]
    CapabilityMissing {
        /// The missing capability, e.g. `concurrent managed access`.
        capability: &'static str,
        /// The device's ordinal.
        device: usize,
        /// The operation that needed it.
        operation: &'static str,
    },
    /// A stream capture or graph operation failed (see [`GraphError`](crate::GraphError)).
    #[error(transparent)]
    Graph(#[from] crate::graph::GraphError),
    /// An argument was rejected before reaching the driver.
    #[error("invalid argument to {operation}: {reason}")]
    InvalidArgument {
        /// The operation that rejected it.
        operation: &'static str,
        /// What was wrong, with the offending value.
        reason: String,
    },
}

impl DriverError {
    /// Whether this is a capture refusal ([`GraphError::Capturing`](crate::GraphError::Capturing)):
    /// the call would have broken an active stream capture, or recorded into it what must run
    /// once, and was not made. It says "not now", not that the work asked about failed: once
    /// the capture ends the same call can be made again.
    pub fn is_capture_refusal(&self) -> bool {
        matches!(
            self,
            Self::Graph(crate::graph::GraphError::Capturing { .. })
        )
    }

    /// The raw `CUresult`, when the driver itself reported the error.
    pub fn code(&self) -> Option<sys::CUresult> {
        match self {
            Self::Cuda { code, .. } | Self::ModuleLoad { code, .. } => Some(sys::CUresult(*code)),
            _ => None,
        }
    }

    /// The driver's name for the code of a [`Cuda`](Self::Cuda) or
    /// [`ModuleLoad`](Self::ModuleLoad) error, e.g.
    /// `CUDA_ERROR_OUT_OF_MEMORY` (`cuGetErrorName`, asked now; `CUresult N` when no driver is
    /// loaded or it does not know the code); `None` for the other variants.
    pub fn name(&self) -> Option<Cow<'static, str>> {
        match self {
            Self::Cuda { code, .. } | Self::ModuleLoad { code, .. } => Some(cuda_name(*code)),
            _ => None,
        }
    }

    /// The driver's description of the code of a [`Cuda`](Self::Cuda) or
    /// [`ModuleLoad`](Self::ModuleLoad) error
    /// (`cuGetErrorString`, asked now; `unknown error` when no driver is loaded or it does not
    /// know the code); `None` for the other variants.
    pub fn description(&self) -> Option<&'static str> {
        match self {
            Self::Cuda { code, .. } | Self::ModuleLoad { code, .. } => {
                Some(cuda_description(*code))
            }
            _ => None,
        }
    }

    /// The operation (driver entry point or cuweave function) that failed; `None` for
    /// [`NotFound`](Self::NotFound) and [`Unsupported`](Self::Unsupported).
    pub fn operation(&self) -> Option<&'static str> {
        match self {
            Self::Cuda { operation, .. }
            | Self::ModuleLoad { operation, .. }
            | Self::CapabilityMissing { operation, .. }
            | Self::InvalidArgument { operation, .. } => Some(operation),
            Self::Graph(error) => error.operation(),
            Self::NotFound { .. } | Self::Unsupported { .. } => None,
        }
    }

    /// The JIT compiler's log of a failed module load ([`ModuleLoad`](Self::ModuleLoad)),
    /// `None` for the other variants. Empty when the compiler wrote nothing.
    pub fn jit_log(&self) -> Option<&str> {
        match self {
            Self::ModuleLoad { log, .. } => Some(log),
            _ => None,
        }
    }

    /// Whether the driver reported `CUDA_ERROR_OUT_OF_MEMORY`.
    pub fn is_out_of_memory(&self) -> bool {
        self.code() == Some(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
    }

    /// Whether the driver reported `CUDA_ERROR_NOT_READY` (work still pending; not a failure).
    pub fn is_not_ready(&self) -> bool {
        self.code() == Some(sys::CUresult::CUDA_ERROR_NOT_READY)
    }

    /// Whether no driver is installed (as opposed to a driver that failed). A kernel or global
    /// name that a module does not define is [`is_name_not_found`](Self::is_name_not_found).
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::NotFound { .. })
    }

    /// Whether the driver reported `CUDA_ERROR_NOT_FOUND`: a name that is not there, such as a
    /// kernel or global that a module does not define ([`Module::function`](crate::Module::function),
    /// [`Module::global`](crate::Module::global)).
    pub fn is_name_not_found(&self) -> bool {
        self.code() == Some(sys::CUresult::CUDA_ERROR_NOT_FOUND)
    }

    pub(crate) fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            operation,
            reason: reason.into(),
        }
    }
}

/// The driver's name for `code`, asked of the loaded driver (never loading one).
fn cuda_name(code: u32) -> Cow<'static, str> {
    crate::loader::loaded_driver()
        .and_then(|api| api.error_name(sys::CUresult(code)))
        .map_or_else(|| Cow::Owned(format!("CUresult {code}")), Cow::Borrowed)
}

/// The JIT log on lines of its own after the error's first line, or nothing when it is empty.
fn jit_log_suffix(log: &str) -> String {
    if log.is_empty() {
        String::new()
    } else {
        format!("; JIT log:\n{log}")
    }
}

/// The driver's description of `code`, asked of the loaded driver (never loading one).
fn cuda_description(code: u32) -> &'static str {
    crate::loader::loaded_driver()
        .and_then(|api| api.error_description(sys::CUresult(code)))
        .unwrap_or("unknown error")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::GraphError;

    #[test]
    fn only_a_capture_refusal_is_a_capture_refusal() {
        let refusal = DriverError::Graph(GraphError::Capturing {
            operation: "Event::query",
            reason: "a blocking call or event query now would invalidate the capture",
        });
        assert!(refusal.is_capture_refusal());
        let invalidated = DriverError::Graph(GraphError::CaptureInvalidated {
            broken_by: None,
            code_name: None,
        });
        assert!(!invalidated.is_capture_refusal());
        let sticky = DriverError::Cuda {
            code: 719,
            operation: "cuEventQuery",
        };
        assert!(!sticky.is_capture_refusal());
        let missing = DriverError::NotFound {
            searched: "libcuda.so.1".to_owned(),
            reason: "not installed".to_owned(),
        };
        assert!(!missing.is_capture_refusal());
    }

    /// A refused module reads like the driver error it is, plus the JIT's log on lines of its
    /// own; with no log, exactly like a `Cuda` error of the same code and operation.
    #[test]
    fn a_module_load_error_shows_the_jit_log() {
        let log = "ptxas application ptx input, line 7; error   : Unknown symbol '%r9'";
        let error = DriverError::ModuleLoad {
            code: 218,
            operation: "cuModuleLoadDataEx",
            log: log.to_owned(),
        };
        assert_eq!(error.code(), Some(sys::CUresult(218)));
        assert!(error.name().is_some() && error.description().is_some());
        assert_eq!(error.operation(), Some("cuModuleLoadDataEx"));
        assert_eq!(error.jit_log(), Some(log));
        let shown = error.to_string();
        assert!(shown.starts_with("cuModuleLoadDataEx failed: "), "{shown}");
        assert!(shown.ends_with(&format!("; JIT log:\n{log}")), "{shown}");

        let silent = DriverError::ModuleLoad {
            code: 209,
            operation: "cuModuleLoadDataEx",
            log: String::new(),
        };
        let plain = DriverError::Cuda {
            code: 209,
            operation: "cuModuleLoadDataEx",
        };
        assert_eq!(silent.to_string(), plain.to_string());
        assert_eq!(silent.jit_log(), Some(""));
        assert_eq!(plain.jit_log(), None);
    }
}
