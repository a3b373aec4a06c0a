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
    /// The buffer's memory is a graph allocation of capture `capture` (a stream-ordered
    /// resource's allocation made on a capturing stream): it exists only while a launch of that
    /// graph holds it, so only work captured into that capture may use it.
    #[error(
        "{operation}: the buffer was allocated inside capture {capture}, as a graph allocation that exists only while the graph runs; only work captured into that capture can use it (allocate before the capture, or from the caching allocator, to use it eagerly)"
    )]
    GraphAllocation {
        /// The refused operation.
        operation: &'static str,
        /// The capture whose graph allocates the memory.
        capture: u64,
    },
    /// An allocator setting is unknown, not implemented, or out of its range
    /// ([`AllocatorConfig`](crate::caching::AllocatorConfig)).
    #[error("allocator option {option}: {reason}")]
    InvalidConfig {
        /// The option, as written.
        option: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A pointer handed back to an allocator or pool is not one it gave out.
    #[error("{operation}: {ptr:#x} was not allocated here (or was already freed)")]
    UnknownAllocation {
        /// The operation.
        operation: &'static str,
        /// The pointer.
        ptr: u64,
    },
    /// A resource's memory that a cuweave object owns (a typed buffer, a caching allocator's
    /// segment) was handed to [`MemoryResource::deallocate`](crate::resource::MemoryResource):
    /// only its owner frees it, when it is dropped.
    #[error(
        "{operation}: {ptr:#x} belongs to a typed buffer or a cache segment, which frees it when dropped"
    )]
    OwnedAllocation {
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

/// A copy with a host side that was refused or failed: the [`MemoryError`], and the host side
/// it was given (a `Vec`, a `Box`, a [`PinnedBuffer`](crate::PinnedBuffer)) whenever no copy of
/// it can still run, so an owned buffer is never lost to an error.
///
/// The host side comes back for every refusal made before anything is queued (a length or
/// range error, another device's stream, a pageable buffer on a capturing stream) and for a
/// failure after which the stream was settled. It is `None` only when the copy may still be
/// running (the stream could not be synchronised after a failure): its memory is then leaked,
/// never freed under the copy engine. A sink handed back after a failed copy holds unspecified
/// contents.
///
/// `?` converts it into a [`MemoryError`] (dropping the host side) in functions that return
/// this crate's [`Result`].
///
/// ```no_run
/// # use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
/// # fn demo(buffer: &mut DeviceBuffer<f32>, stream: &cuweave_driver::Stream, data: Vec<f32>) -> Result<(), MemoryError> {
/// let data = match buffer.copy_from_host_async(data, stream) {
///     Ok(pending) => pending.wait()?,
///     Err(refused) if refused.error().is_capture_refusal() => {
///         // Capturing: keep the data and upload it once the capture has ended.
///         refused.into_host().expect("refused before anything was queued")
///     }
///     Err(failed) => return Err(failed.into()),
/// };
/// # drop(data);
/// # Ok(())
/// # }
/// ```
pub struct HostCopyError<H, E = MemoryError> {
    error: E,
    host: Option<H>,
}

impl<H, E> HostCopyError<H, E> {
    /// `error`, handing back `host` (`None` when the copy may still run and the host side was
    /// leaked). For layers above that wrap these copies in their own errors.
    pub fn new(error: E, host: Option<H>) -> Self {
        Self { error, host }
    }

    /// What went wrong.
    pub fn error(&self) -> &E {
        &self.error
    }

    /// Whether the host side is handed back (see the type's docs for when it is not).
    pub fn has_host(&self) -> bool {
        self.host.is_some()
    }

    /// The host side, when it is handed back.
    pub fn into_host(self) -> Option<H> {
        self.host
    }

    /// The error and the host side.
    pub fn into_parts(self) -> (E, Option<H>) {
        (self.error, self.host)
    }

    /// The error alone (the host side, if any, is dropped).
    pub fn into_error(self) -> E {
        self.error
    }

    /// The same host side with the error converted (into a layer's own error type).
    pub fn map_error<F>(self, convert: impl FnOnce(E) -> F) -> HostCopyError<H, F> {
        HostCopyError {
            error: convert(self.error),
            host: self.host,
        }
    }
}

impl<H> From<HostCopyError<H>> for MemoryError {
    fn from(error: HostCopyError<H>) -> Self {
        error.error
    }
}

impl<H, E: std::fmt::Debug> std::fmt::Debug for HostCopyError<H, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCopyError")
            .field("error", &self.error)
            .field("host_returned", &self.host.is_some())
            .finish()
    }
}

impl<H, E: std::fmt::Display> std::fmt::Display for HostCopyError<H, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.error, f)
    }
}

impl<H, E: std::error::Error> std::error::Error for HostCopyError<H, E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

/// `$result`'s value, or a return of its error as the host side's refusal
/// ([`HostRefusal`](crate::buffer::HostRefusal)), which hands `$host` back where it is owned:
/// for refusals made before a copy of `$host` is queued.
macro_rules! hand_back_on_error {
    ($result:expr, $host:expr) => {
        match $result {
            Ok(value) => value,
            Err(error) => {
                return Err($crate::buffer::host::sealed::HostSide::refusal(
                    ::std::convert::Into::<$crate::error::MemoryError>::into(error),
                    Some($host),
                ));
            }
        }
    };
}
pub(crate) use hand_back_on_error;

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
