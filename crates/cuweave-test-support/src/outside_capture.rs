//! A stream capture begun with the driver's own calls, which cuweave does not count: for tests
//! that check a refusal also catches captures begun outside cuweave (by another library).

use std::sync::Arc;

use cuweave_driver::{Context, DriverError, Graph, Stream, driver, sys};

/// Runs `during` while `stream` (of `context`) captures in relaxed mode through
/// `cuStreamBeginCapture` / `cuStreamEndCapture` called directly, so that
/// [`active_captures`](cuweave_driver::graph::active_captures) stays 0; returns what `during`
/// returned and the graph recorded.
///
/// # Panics
/// When the driver refuses to begin or end the capture (a test failure).
pub fn capture_outside_cuweave<R>(
    context: &Arc<Context>,
    stream: &Stream,
    during: impl FnOnce() -> R,
) -> (R, Graph) {
    let api = driver().expect("driver");
    context.bind_to_thread().expect("bind the context");
    let begin = api
        .stream_begin_capture
        .get()
        .expect("cuStreamBeginCapture");
    // SAFETY: a live stream of the current context; relaxed mode forbids no call `during` makes.
    let begun = unsafe {
        begin(
            stream.as_raw(),
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
        )
    };
    assert_eq!(begun, sys::CUresult::CUDA_SUCCESS, "cuStreamBeginCapture");
    let result = during();
    let end = api.stream_end_capture.get().expect("cuStreamEndCapture");
    let mut raw = std::ptr::null_mut();
    // SAFETY: the stream is the origin of the capture begun above; valid out-pointer.
    let ended = unsafe { end(stream.as_raw(), &mut raw) };
    assert_eq!(ended, sys::CUresult::CUDA_SUCCESS, "cuStreamEndCapture");
    // SAFETY: the driver just made this graph and nobody else owns it.
    (result, unsafe { Graph::from_raw(context, raw) })
}

/// `cuMemAlloc` called directly through the driver table, below every cuweave check (cuweave's
/// own allocations switch to relaxed mode while capturing): the call a global or thread-local
/// capture forbids, for tests of how a broken capture is reported. Checked with
/// [`DriverApi::check`](cuweave_driver::DriverApi::check), so a capture it breaks names it
/// (`cuMemAlloc_v2`). Free the memory with [`raw_mem_free`].
///
/// # Errors
/// The driver's error (a capture it broke among them).
pub fn raw_mem_alloc(context: &Arc<Context>, bytes: usize) -> Result<u64, DriverError> {
    let api = driver()?;
    context.bind_to_thread()?;
    let alloc = api.mem_alloc.get()?;
    let mut ptr = 0;
    // SAFETY: valid out-pointer; the context is current.
    let code = unsafe { alloc(&mut ptr, bytes) };
    api.check(code, api.mem_alloc.symbol())?;
    Ok(ptr)
}

/// `cuMemFree` of memory from [`raw_mem_alloc`], called directly as that is (a capture it
/// breaks names `cuMemFree_v2`).
///
/// # Safety
/// `ptr` came from [`raw_mem_alloc`] in `context`, is freed once, and no queued work uses it.
///
/// # Errors
/// The driver's error (a capture it broke among them).
pub unsafe fn raw_mem_free(context: &Arc<Context>, ptr: u64) -> Result<(), DriverError> {
    let api = driver()?;
    context.bind_to_thread()?;
    let free = api.mem_free.get()?;
    // SAFETY: the caller's contract.
    let code = unsafe { free(ptr) };
    api.check(code, api.mem_free.symbol())
}
