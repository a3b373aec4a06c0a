//! CUDA graphs: stream capture, [`Graph`] and [`GraphExec`] handles, graph memory.
//!
//! A graph is a recorded sequence of device work (kernels, copies, memsets, event waits,
//! allocations) that the driver replays with one launch. The usual way to build one is
//! *stream capture*: [`Stream::begin_capture`](crate::Stream::begin_capture) makes the driver
//! record, rather than run, what is queued on the stream (and on every stream that waits on an
//! event recorded in it), and [`Stream::end_capture`](crate::Stream::end_capture) hands the
//! recording back as a [`Graph`]. [`Graph::instantiate`] turns it into an executable
//! [`GraphExec`], launched on any stream of its context for a few microseconds of host time
//! whatever its size.
//!
//! | item | what it is |
//! |---|---|
//! | [`CaptureMode`], [`CaptureStatus`] | how strictly a capture guards against unsafe calls; a stream's capture state |
//! | [`active_captures`], [`refuse_while_capturing`] | the process's capture count (one atomic load), and the check that turns a call that would break a capture into [`GraphError::Capturing`] |
//! | [`refuse_legacy_stream_use`], [`refuse_on_legacy_stream`] | the check that refuses any use of a context's legacy default stream (blocking copies and memsets, work on [`Stream::legacy_default`](crate::Stream::legacy_default)) while a blocking stream of that context captures, which the driver answers by invalidating the capture |
//! | [`refuse_recording`], [`StatusCheck`] | the check that refuses work which must not be recorded into a graph (host functions, completion-word writes) on a capturing stream |
//! | [`capture_state`], [`known_complete_before`], [`capture_is_active`] | the capture epoch that buffer trackers stamp uses with, and which uses a capture knows to be complete (`Stream::begin_capture_synchronized`) |
//! | [`CaptureModeGuard`], [`relaxed_during_captures`] | this thread in another capture mode for a scope (`cuThreadExchangeStreamCaptureMode`); relaxed, for one call a capture does not record, only while a cuweave capture is active |
//! | [`Graph`], [`GraphExec`], [`InstantiateOptions`] | the recording and its executable form: instantiate, upload, launch, update, DOT dump |
//! | [`KeepAlive`], [`SynchronizingKeepAlive`], [`held_for_dropped_executables`] | values a graph keeps alive for its executables (fenced behind their launches, or waiting for the device themselves), and what dropped executables still hold for their unfinished launches |
//! | [`synchronize_launches`], [`launched_since`], [`LaunchMark`] | the process's graph launches, counted: a context wait that covers every launch so far, and whether one has begun since (host access to memory a graph may use) |
//! | [`HostBorrow`], [`host_borrowed_captures`] | a live host borrow of memory that tracked captures used: their graphs' launches are refused until it ends |
//! | [`wait_for_graph_launches`], [`fence_eager_use`], [`LaunchesAfter`] | the fences that order graph launches and eager work on memory their captures used, both ways |
//! | [`GraphMemoryUsage`], [`trim_graph_memory`] | the driver's graph memory pool of a device |
//! | [`GraphError`] | every graph-specific failure, inside [`DriverError::Graph`](crate::DriverError::Graph) |
//!
//! An invalidated capture is reported as one [`GraphError::CaptureInvalidated`] naming the first
//! driver call that failed with a capture error after the capture began: by
//! [`Stream::end_capture`](crate::Stream::end_capture), and by every call made on the broken
//! capture before that, instead of the driver's bare `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
//! Guide: `docs/graphs.md`.

mod capture;
mod error;
mod exec;
mod fences;
mod handle;
mod keep_alive;
mod launches;
mod memory;

#[cfg(test)]
pub(crate) use capture::CAPTURE_COUNT_TEST_LOCK;
pub use capture::{
    CaptureMode, CaptureModeGuard, CaptureState, CaptureStatus, StatusCheck, active_captures,
    capture_is_active, capture_state, known_complete_before, note_tracked_use, outside_captures,
    outside_captures_or_relaxed, refuse_legacy_stream_use, refuse_on_legacy_stream,
    refuse_recording, refuse_wait_across_capture, refuse_while_capturing, relaxed_during_captures,
    wait_for_no_global_capture,
};
pub(crate) use capture::{between_capture_begins, captures_ended};
pub(crate) use capture::{relaxed_beside_captures, relaxed_for_unrecorded_call};
pub use error::GraphError;
pub use exec::{GraphExec, InstantiateOptions, held_for_dropped_executables};
pub use fences::{
    LaunchesAfter, PRUNE_FENCES_AT, eager_use_fences, fence_eager_use, graph_launch_fences,
    wait_for_graph_launches,
};
pub use handle::{Graph, GraphNodeType, KeepAlive, SynchronizingKeepAlive};
pub use launches::{
    HostBorrow, LaunchMark, host_borrowed_captures, launched_since, synchronize_launches,
};
pub use memory::{GraphMemoryUsage, graph_memory_usage, trim_graph_memory};

pub(crate) use capture::{
    RecordedIn, note_driver_failure, refuse_dependency_across_capture, translate_driver_failure,
    while_no_capture_begins,
};
pub(crate) use error::is_capture_code;
