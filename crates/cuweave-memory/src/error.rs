//! [`MemoryError`]: what can go wrong in the memory layer.

use cuweave_driver::DriverError;

/// A result whose error is a [`MemoryError`].
pub type Result<T, E = MemoryError> = std::result::Result<T, E>;

/// Why a memory operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MemoryError {
    /// The driver failed (or is missing, or lacks a capability).
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// A zero-length allocation, copy, range or prefetch was asked for.
    #[error("{operation}: zero-length request")]
    ZeroLength {
        /// The operation that was asked for nothing.
        operation: &'static str,
    },
    /// An offset and length run past the end of the buffer or range.
    #[error("{operation}: range {offset}..{offset}+{len} is outside a buffer of {capacity}")]
    OutOfRange {
        /// The operation.
        operation: &'static str,
        /// Start of the requested range (elements or bytes, as the operation says).
        offset: usize,
        /// Length of the requested range.
        len: usize,
        /// Size of what it was taken from.
        capacity: usize,
    },
    /// Two sides of a copy differ in length.
    #[error("{operation}: length mismatch: expected {expected}, got {actual}")]
    SizeMismatch {
        /// The operation.
        operation: &'static str,
        /// The length required.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// A byte size does not fit the element type, or overflows.
    #[error(
        "{operation}: {bytes} bytes is not a whole number of {element_size}-byte elements or overflows"
    )]
    Misaligned {
        /// The operation.
        operation: &'static str,
        /// The byte count given.
        bytes: usize,
        /// Size of one element.
        element_size: usize,
    },
    /// The allocator could not satisfy a request, even after freeing its cache and retrying.
    #[error(
        "out of memory: requested {requested} bytes with {allocated} allocated and {reserved} reserved{}",
        limit.map(|l| format!(" (limit {l})")).unwrap_or_default()
    )]
    OutOfMemory {
        /// Bytes requested (after rounding).
        requested: usize,
        /// Bytes handed out to users at the time.
        allocated: usize,
        /// Bytes held from the upstream resource at the time.
        reserved: usize,
        /// The cap of a limiting adaptor, when one refused.
        limit: Option<usize>,
    },
    /// Host access to unified memory was asked for while device work may still touch it.
    #[error("{operation}: device work queued on stream {stream:#x} may still use this buffer")]
    DeviceBusy {
        /// The operation.
        operation: &'static str,
        /// The raw stream handle of the pending work, for diagnostics.
        stream: usize,
    },
    /// An object of one device (or pool) was used with another.
    #[error("{operation}: belongs to device {expected}, used with device {actual}")]
    WrongDevice {
        /// The operation.
        operation: &'static str,
        /// The device it belongs to.
        expected: usize,
        /// The device it was used with.
        actual: usize,
    },
    /// An object of one context was used with another context of the same device (the
    /// default caching allocator serves the device's primary context; give a buffer of another
    /// context its own [`MemoryResource`](crate::MemoryResource)).
    #[error("{operation}: belongs to another context of device {device}")]
    WrongContext {
        /// The operation.
        operation: &'static str,
        /// The device both contexts are on.
        device: usize,
    },
    /// A write through a shared view ([`Buffer::slice`](crate::Buffer::slice)); writes need
    /// [`Buffer::slice_mut`](crate::Buffer::slice_mut) or the buffer itself.
    #[error("{operation}: a shared view is read-only")]
    ReadOnlyView {
        /// The operation.
        operation: &'static str,
    },
    /// A stream handle that cannot key stream-ordered memory (`CU_STREAM_PER_THREAD`, whose one
    /// handle names a different stream on each thread), or a chunk queued with progress marks
    /// of another stream.
    #[error("{operation}: {reason}")]
    InvalidStream {
        /// The operation.
        operation: &'static str,
        /// Why the stream was refused.
        reason: &'static str,
    },
    /// A capture already bound to one graph pool was asked to allocate to another: its graph
    /// keeps only the pool it was bound to, so memory used after a rebind would be named by a
    /// pool the graph does not keep alive. Binding the same pool again is fine.
    #[error(
        "{operation}: capture {capture} is bound to {bound}; it cannot be rebound to {requested}"
    )]
    CaptureBoundToAnotherPool {
        /// The operation.
        operation: &'static str,
        /// The capture sequence's id.
        capture: u64,
        /// The pool the capture is bound to (and stays bound to).
        bound: crate::caching::GraphPoolId,
        /// The pool that was refused.
        requested: crate::caching::GraphPoolId,
    },
    /// An operation that a stream capture cannot hold was asked of a capturing stream, and was
    /// refused before anything was queued: the capture is still valid and can go on. A copy
    /// between a device buffer and pageable host memory (a `Vec<T>` or `Box<[T]>` host side) is
    /// one (the driver would answer it with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and
    /// invalidate the whole capture); so are copies that return only once they have landed, and
    /// fills whose value no memset can write (they stage it in pageable memory behind a host
    /// function). The same call succeeds on a stream that is not capturing.
    #[error(
        "{operation} cannot be recorded into a stream capture ({reason}); nothing was queued and the capture is intact"
    )]
    NotCapturable {
        /// The refused operation.
        operation: &'static str,
        /// Why a capture cannot hold it.
        reason: &'static str,
    },
    /// A pointer handed back to an allocator or pool is not one it gave out.
    #[error("{operation}: {ptr:#x} was not allocated here (or was already freed)")]
    UnknownAllocation {
        /// The operation.
        operation: &'static str,
        /// The pointer.
        ptr: u64,
    },
}

impl MemoryError {
    /// Whether this is an out-of-memory failure, from the allocator or from the driver.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Self::OutOfMemory { .. } => true,
            Self::Driver(error) => error.is_out_of_memory(),
            _ => false,
        }
    }

    /// Whether the operation was refused because a stream capture is active (it would have
    /// waited for the device or broken the capture); it may succeed once no capture is.
    ///
    /// Both the driver layer's refusal ([`GraphError::Capturing`](cuweave_driver::GraphError::Capturing))
    /// and this layer's [`NotCapturable`](Self::NotCapturable) count.
    pub fn is_capture_refusal(&self) -> bool {
        match self {
            Self::Driver(error) => error.is_capture_refusal(),
            Self::NotCapturable { .. } => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_capturable_is_a_capture_refusal_naming_the_operation() {
        let error = MemoryError::NotCapturable {
            operation: "Buffer::copy_range_from_host_async",
            reason: crate::buffer::capture::PAGEABLE,
        };
        assert!(error.is_capture_refusal());
        assert!(!error.is_out_of_memory());
        let text = error.to_string();
        assert!(
            text.starts_with("Buffer::copy_range_from_host_async cannot be recorded"),
            "{text}"
        );
        assert!(text.contains("pageable"), "{text}");
        assert!(!MemoryError::ZeroLength { operation: "x" }.is_capture_refusal());
    }
}
