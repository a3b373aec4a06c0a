//! [`GraphError`]: what can go wrong with a capture or a graph, beyond a plain driver error.

/// Why a capture or graph operation failed. Carried by
/// [`DriverError::Graph`](crate::DriverError::Graph).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GraphError {
    /// Capture was asked for on the legacy default stream, which synchronises with every other
    /// blocking stream of its context and so cannot be captured safely.
    #[error("{operation}: the legacy default stream cannot be captured; use a non-blocking stream")]
    LegacyDefaultStream {
        /// The operation.
        operation: &'static str,
    },
    /// A call that would wait for the device, query an event or allocate from the driver was
    /// refused because a capture is active, instead of letting it break the capture.
    #[error("{operation} refused: a stream capture is active ({reason})")]
    Capturing {
        /// The refused operation.
        operation: &'static str,
        /// Why it would have broken the capture.
        reason: &'static str,
    },
    /// The stream is already capturing.
    #[error("stream {stream} is already capturing")]
    AlreadyCapturing {
        /// The stream's id.
        stream: u64,
    },
    /// The stream is not capturing (or the capture was begun on another stream).
    #[error("{operation}: stream {stream} is not the origin of an active capture")]
    NotCapturing {
        /// The operation.
        operation: &'static str,
        /// The stream's id.
        stream: u64,
    },
    /// The capture was invalidated by a call that stream capture does not allow.
    #[error("the capture was invalidated; the first call that broke it: {}", broken_by_text(.broken_by, .code_name))]
    CaptureInvalidated {
        /// The driver entry point whose capture error came first after the capture began, when
        /// cuweave made that call.
        broken_by: Option<&'static str>,
        /// The driver's name for that call's error code.
        code_name: Option<&'static str>,
    },
    /// A stream forked into the capture (it waited on an event recorded in it) was never joined
    /// back into the origin stream before the capture ended.
    #[error("a stream forked into the capture was not joined back before end_capture")]
    UnjoinedFork,
    /// Instantiation failed; the driver's reason and the node it blamed.
    #[error("graph instantiation failed: {result}{}", node_text(.node_type))]
    Instantiate {
        /// The `CUgraphInstantiateResult` name.
        result: &'static str,
        /// The type of the node that failed, when the driver named one.
        node_type: Option<super::GraphNodeType>,
    },
    /// A graph with memory-allocation nodes, instantiated without auto-free, was launched again
    /// before its allocations were freed (the driver would fail with `INVALID_VALUE`).
    #[error(
        "this graph allocates memory and was instantiated without auto_free_on_launch: it cannot be relaunched"
    )]
    RelaunchNeedsAutoFree,
    /// `cuGraphExecUpdate` refused the new graph (another shape, another kernel, ...).
    #[error("graph update refused: {reason}{}", node_text(.node_type))]
    UpdateRejected {
        /// The `CUgraphExecUpdateResult` name.
        reason: &'static str,
        /// The type of the node that blocked the update, when the driver named one.
        node_type: Option<super::GraphNodeType>,
    },
    /// The graph, ended from capture `capture`, may use memory the host is borrowing now
    /// (a host slice of a pinned or unified buffer that capture wrote, or used while the host
    /// writes): launched, it would race the host's reads or writes. Drop the slice first.
    #[error(
        "a graph of capture {capture} was not launched: the host borrows memory it uses (drop the host slice first)"
    )]
    HostBorrowed {
        /// The capture the graph was ended from.
        capture: u64,
    },
    /// The graph, ended from capture `capture` in which tracked buffers were used, was launched
    /// into another capture. The graph recorded there would replay it with neither the ordering
    /// against eager work nor the lifetimes that cuweave keeps for those buffers under its own
    /// capture. Refused before anything is queued; the capture stays valid.
    #[error(
        "a graph of capture {capture} uses tracked buffers and cannot be launched into another capture (capture that work directly)"
    )]
    TrackedGraphInCapture {
        /// The capture the graph was ended from.
        capture: u64,
    },
}

impl GraphError {
    /// The operation that failed, where the error names one.
    pub fn operation(&self) -> Option<&'static str> {
        match self {
            Self::LegacyDefaultStream { operation }
            | Self::Capturing { operation, .. }
            | Self::NotCapturing { operation, .. } => Some(operation),
            Self::CaptureInvalidated { broken_by, .. } => *broken_by,
            Self::AlreadyCapturing { .. } => Some("Stream::begin_capture"),
            Self::UnjoinedFork => Some("Stream::end_capture"),
            Self::Instantiate { .. } => Some("Graph::instantiate"),
            Self::RelaunchNeedsAutoFree
            | Self::HostBorrowed { .. }
            | Self::TrackedGraphInCapture { .. } => Some("GraphExec::launch"),
            Self::UpdateRejected { .. } => Some("GraphExec::update"),
        }
    }
}

/// Whether `code` is one of the driver's stream-capture errors (900 to 908, `CUDA_ERROR_STREAM_
/// CAPTURE_*` and `CUDA_ERROR_CAPTURED_EVENT`).
pub(crate) fn is_capture_code(code: crate::sys::CUresult) -> bool {
    (900..=908).contains(&code.0)
}

/// The name of a capture error code (900 to 908), without a driver call.
pub(crate) fn capture_error_name(code: crate::sys::CUresult) -> &'static str {
    match code.0 {
        900 => "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
        901 => "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED",
        902 => "CUDA_ERROR_STREAM_CAPTURE_MERGE",
        903 => "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED",
        904 => "CUDA_ERROR_STREAM_CAPTURE_UNJOINED",
        905 => "CUDA_ERROR_STREAM_CAPTURE_ISOLATION",
        906 => "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT",
        907 => "CUDA_ERROR_CAPTURED_EVENT",
        908 => "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD",
        _ => "a capture error",
    }
}

fn broken_by_text(broken_by: &Option<&'static str>, code_name: &Option<&'static str>) -> String {
    match (broken_by, code_name) {
        (Some(call), Some(code)) => format!("{call} ({code})"),
        (Some(call), None) => (*call).to_string(),
        _ => "a call made outside cuweave".to_string(),
    }
}

fn node_text(node_type: &Option<super::GraphNodeType>) -> String {
    node_type.map_or_else(String::new, |node| format!(" (at a {node:?} node)"))
}
