//! [`StreamError`]: what can go wrong in the stream layer.

use cuweave_driver::DriverError;
use cuweave_memory::MemoryError;

/// A result whose error is a [`StreamError`].
pub type Result<T, E = StreamError> = std::result::Result<T, E>;

/// Why a stream-layer operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum StreamError {
    /// The driver failed (or is missing, or lacks a capability).
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The memory layer refused or failed (bad range, zero length, out of memory, ...).
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// A stream (or buffer, or allocation) of one device was used with another device.
    #[error("{operation}: belongs to device {expected}, used with device {actual}")]
    WrongDevice {
        /// The operation.
        operation: &'static str,
        /// The device the stream (or pool) belongs to.
        expected: usize,
        /// The device of what it was used with.
        actual: usize,
    },
    /// A stream cannot depend on itself (its work is already in order).
    #[error("{operation}: stream {stream} cannot depend on itself")]
    SelfDependency {
        /// The operation.
        operation: &'static str,
        /// The stream's id.
        stream: u64,
    },
    /// A pool configuration or argument that cannot work (no streams at all, zero sizes, ...).
    #[error("{operation}: {reason}")]
    InvalidArgument {
        /// The operation.
        operation: &'static str,
        /// What is wrong with the input.
        reason: String,
    },
    /// A workload has no stream to run on in this pool's configuration.
    #[error("no stream in the pool serves {workload} work")]
    NoStreamForWorkload {
        /// The workload asked for.
        workload: crate::WorkloadType,
    },
    /// The operating system refused to start a thread (a stream's callback worker).
    #[error("{operation}: starting the thread `{thread}` failed: {reason}")]
    ThreadSpawn {
        /// The operation that needed the thread.
        operation: &'static str,
        /// The thread's name.
        thread: String,
        /// The operating system's error.
        reason: String,
    },
    /// An allocation id that the allocator does not hold (never made, or already freed).
    #[error("{operation}: allocation {allocation} is not held by this allocator")]
    UnknownAllocation {
        /// The operation.
        operation: &'static str,
        /// The allocation's id.
        allocation: u64,
    },
    /// A profiled operation has not finished on the GPU, so it has no GPU time yet.
    #[error("{operation}: the GPU has not finished the operation yet")]
    NotReady {
        /// The operation.
        operation: &'static str,
    },
    /// Some of the closures run by `execute_parallel` failed; every failure is listed.
    #[error("{} of the parallel stream closures failed: {}", failures.len(), format_failures(failures))]
    Parallel {
        /// Each failing stream's id and its error.
        failures: Vec<(u64, StreamError)>,
    },
    /// A parallel closure panicked; the panic was caught.
    #[error("{operation}: the closure for stream {stream} panicked: {message}")]
    Panicked {
        /// The operation.
        operation: &'static str,
        /// The stream whose closure panicked.
        stream: u64,
        /// The panic's message.
        message: String,
    },
}

impl StreamError {
    pub(crate) fn invalid(operation: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidArgument {
            operation,
            reason: reason.into(),
        }
    }
}

fn format_failures(failures: &[(u64, StreamError)]) -> String {
    failures
        .iter()
        .map(|(stream, error)| format!("stream {stream}: {error}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// An error unless `expected` and `actual` are the same device ordinal.
pub(crate) fn ensure_device(operation: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(StreamError::WrongDevice {
            operation,
            expected,
            actual,
        })
    }
}

/// The message of a caught panic payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = payload.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text.clone()
    } else {
        "a panic with a non-string payload".to_string()
    }
}

impl<H> From<cuweave_memory::HostCopyError<H, StreamError>> for StreamError {
    /// The error of a refused or failed copy, its host side dropped.
    fn from(error: cuweave_memory::HostCopyError<H, StreamError>) -> Self {
        error.into_error()
    }
}

impl<H> From<cuweave_memory::HostCopyError<H>> for StreamError {
    /// The memory layer's error of a refused or failed copy, its host side dropped.
    fn from(error: cuweave_memory::HostCopyError<H>) -> Self {
        error.into_error().into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_device_is_typed() {
        assert!(ensure_device("op", 0, 0).is_ok());
        assert_eq!(
            ensure_device("op", 0, 1),
            Err(StreamError::WrongDevice {
                operation: "op",
                expected: 0,
                actual: 1
            })
        );
    }

    #[test]
    fn parallel_errors_list_every_failure() {
        let error = StreamError::Parallel {
            failures: vec![
                (1, StreamError::invalid("a", "x")),
                (2, StreamError::invalid("b", "y")),
            ],
        };
        assert_eq!(
            error.to_string(),
            "2 of the parallel stream closures failed: stream 1: a: x; stream 2: b: y"
        );
    }

    #[test]
    fn panic_messages_are_recovered() {
        let caught = std::panic::catch_unwind(|| panic!("boom {}", 7)).unwrap_err();
        assert_eq!(panic_message(&*caught), "boom 7");
        let caught = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        assert_eq!(panic_message(&*caught), "plain");
    }
}
