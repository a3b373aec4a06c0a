//! [`GraphExec`]: an instantiated graph, launched on streams.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::error::GraphError;
use super::handle::{Graph, GraphNodeType, KeepAlive};
use super::keep_alive::{Deferred, Retirement, deduplicated};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::event::{Event, EventFlags};
use crate::event_pool::{EventPool, OwnedPooledEvent};
use crate::loader::{cu, driver};
use crate::stream::Stream;
use crate::sys;

/// How [`Graph::instantiate`] builds the executable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct InstantiateOptions {
    /// For graphs that allocate memory: free what the previous launch allocated and did not
    /// free before each relaunch (`AUTO_FREE_ON_LAUNCH`). Default `true`; with `false` such a
    /// graph can be launched only once. Either way the last launch's allocations stay allocated
    /// after the executable is dropped, at the graph's fixed addresses, until freed
    /// (`cuMemFreeAsync`), as CUDA specifies for graph allocations.
    pub auto_free_on_launch: bool,
    /// Launch kernel nodes with the priorities they were captured with
    /// (`USE_NODE_PRIORITY`) instead of the launching stream's. Default `false`.
    pub use_node_priority: bool,
}

impl Default for InstantiateOptions {
    fn default() -> Self {
        Self {
            auto_free_on_launch: true,
            use_node_priority: false,
        }
    }
}

impl InstantiateOptions {
    /// Sets [`auto_free_on_launch`](Self::auto_free_on_launch).
    pub fn with_auto_free_on_launch(mut self, enabled: bool) -> Self {
        self.auto_free_on_launch = enabled;
        self
    }

    /// Sets [`use_node_priority`](Self::use_node_priority).
    pub fn with_node_priority(mut self, enabled: bool) -> Self {
        self.use_node_priority = enabled;
        self
    }
}

/// An executable graph (`CUgraphExec`): launched on any stream of its context with one driver
/// call, whatever its size. Destroyed on drop; queued launches still complete.
///
/// `Send + Sync`: launches, uploads and updates of one executable are serialised by a lock
/// (the driver does not synchronise them itself).
///
/// # Keep-alives across updates
/// The executable keeps alive what its graph keeps alive ([`Graph::keep_alive`]), each value
/// once. After an [`update`](Self::update) the new graph's values are current; the previous
/// generation is still held for the launches made before the update, and dropped by a later
/// `update` once they have all finished. CUDA runs an executable's launches one after another,
/// so an event recorded (from the context's [`EventPool`]) behind the first launch after an
/// update proves it: one event record per update, none on other launches. A generation never
/// launched is dropped at the next update at once. So however many update loops run, what is
/// held is the current generation plus the generations still in flight.
///
/// # Keep-alives after a drop
/// Dropping the executable does not wait for its queued launches, and neither do the values it
/// keeps alive: while it holds any given to [`Graph::keep_alive`], each launch on a stream that
/// is not capturing re-records one event of its own behind itself (a `cuEventRecord`, no pool
/// round trip; values given to [`Graph::keep_alive_synchronizing`] wait for the device
/// themselves and cost nothing), and at drop the
/// values whose last launch has not finished wait, with that event, until a later
/// instantiate, update or drop of any executable finds it complete
/// ([`held_for_dropped_executables`] counts them). A launch *into* a capture becomes a node of
/// that capture's graph, which these values cannot follow: keep them alive with that graph
/// ([`Graph::keep_alive`]) too.
pub struct GraphExec {
    context: Arc<Context>,
    raw: sys::CUgraphExec,
    /// Serialises driver calls on `raw`; holds what launches leave behind.
    lock: Mutex<LaunchState>,
    /// The graph allocates memory and was instantiated without auto-free.
    single_launch: bool,
    launches: AtomicU64,
    /// The current generation, each value once (replaced only under `&mut self`).
    keep_alive: Vec<KeepAlive>,
    /// The context's shared event pool, for the events recorded behind launches (keep-alive
    /// retirement, `fences`); taken on first use.
    event_pool: std::sync::OnceLock<EventPool>,
    /// The capture of the current graph, when tracked buffers were used in it: launches leave
    /// fences under it.
    tracked_capture: Option<u64>,
    /// A graph it ran (the first, or one of an update) kept a value alive with
    /// [`Graph::keep_alive`]: launches re-record `behind_last` while values are held.
    launch_fenced: bool,
}

/// What launches leave behind, under the executable's lock.
#[derive(Default)]
struct LaunchState {
    /// Old keep-alive generations, each waiting for a launch after its update to finish.
    retirement: Retirement<OwnedPooledEvent>,
    /// Re-recorded behind every launch on an eager stream while values are kept alive: the
    /// executable's launches run one after another, so its completion proves they all have.
    behind_last: Option<Event>,
    /// A launch that needed `behind_last` could not record it: at drop nothing proves the
    /// launches finished, so the values are leaked rather than dropped under them.
    unfenced: bool,
}

/// Values of dropped executables whose last launch had not finished at the drop.
static DEFERRED: Mutex<Deferred<Event>> = Mutex::new(Deferred::new());

/// How many values dropped executables still keep alive for launches that had not finished
/// when last looked at (see [Keep-alives after a drop](GraphExec#keep-alives-after-a-drop)).
pub fn held_for_dropped_executables() -> usize {
    DEFERRED.lock().len()
}

/// Drops the values of dropped executables whose launches have finished (outside the lock).
fn release_finished_keep_alives() {
    let finished = DEFERRED.lock().take_finished();
    drop(finished);
}

// SAFETY: a CUgraphExec may be used from any thread; every call on it holds `lock`.
unsafe impl Send for GraphExec {}
// SAFETY: as above.
unsafe impl Sync for GraphExec {}

impl std::fmt::Debug for GraphExec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphExec")
            .field("raw", &self.raw)
            .field("device", &self.context.device().ordinal())
            .field("launches", &self.launch_count())
            .finish()
    }
}

impl GraphExec {
    pub(super) fn instantiate(
        context: &Arc<Context>,
        graph: sys::CUgraph,
        options: &InstantiateOptions,
        allocates: bool,
        keep_alive: Vec<KeepAlive>,
        launch_fenced: bool,
        tracked_capture: Option<u64>,
    ) -> Result<Self> {
        context.bind_to_thread()?;
        let api = driver()?;
        let mut flags = 0u64;
        if allocates && options.auto_free_on_launch {
            flags |= u64::from(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.0,
            );
        }
        if options.use_node_priority {
            flags |= u64::from(
                sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.0,
            );
        }
        let mut params = sys::CUDA_GRAPH_INSTANTIATE_PARAMS {
            flags,
            ..Default::default()
        };
        release_finished_keep_alives();
        let mut raw = std::ptr::null_mut();
        // Relaxed: instantiation is a call the driver counts as unsafe under another thread's
        // global-mode capture (it may allocate); a capture that thread begins meanwhile is then
        // neither broken nor raced by the driver's check (that race was seen to crash inside
        // the driver).
        let _relaxed = super::relaxed_for_unrecorded_call()?;
        // SAFETY: live graph of the current context; valid out-pointers.
        let outcome =
            unsafe { cu!(api.graph_instantiate_with_params(&mut raw, graph, &mut params)) };
        if let Err(error) = outcome {
            if params.result_out != sys::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_SUCCESS {
                return Err(GraphError::Instantiate {
                    result: instantiate_result_name(params.result_out),
                    node_type: GraphNodeType::of(params.hErrNode_out),
                }
                .into());
            }
            return Err(error);
        }
        Ok(Self {
            context: Arc::clone(context),
            raw,
            lock: Mutex::new(LaunchState::default()),
            single_launch: allocates && !options.auto_free_on_launch,
            launches: AtomicU64::new(0),
            event_pool: std::sync::OnceLock::new(),
            tracked_capture,
            launch_fenced,
            keep_alive: deduplicated(&keep_alive),
        })
    }

    /// Wraps an executable graph another library instantiated, destroying it on drop.
    ///
    /// # Safety
    /// `raw` is a live executable graph of `context` that nobody else destroys or uses
    /// concurrently.
    pub unsafe fn from_raw(context: &Arc<Context>, raw: sys::CUgraphExec) -> Self {
        Self {
            context: Arc::clone(context),
            raw,
            lock: Mutex::new(LaunchState::default()),
            single_launch: false,
            launches: AtomicU64::new(0),
            event_pool: std::sync::OnceLock::new(),
            tracked_capture: None,
            launch_fenced: false,
            keep_alive: Vec::new(),
        }
    }

    /// The raw `CUgraphExec` (still owned by this handle).
    pub fn as_raw(&self) -> sys::CUgraphExec {
        self.raw
    }

    /// The context the executable belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// How many times it has been launched through this handle.
    pub fn launch_count(&self) -> u64 {
        self.launches.load(Ordering::Relaxed)
    }

    /// What the executable keeps alive for its current parameters: its graph's keep-alives,
    /// or those of the graph of the last [`update`](Self::update), each value once.
    pub fn kept_alive(&self) -> &[KeepAlive] {
        &self.keep_alive
    }

    /// How many values the executable holds in all: the current generation and the older ones
    /// still held for launches made before an update (see
    /// [Keep-alives across updates](Self#keep-alives-across-updates)).
    pub fn kept_alive_count(&self) -> usize {
        self.keep_alive.len() + self.lock.lock().retirement.retired_len()
    }

    /// Queues the whole graph on `stream` (`cuGraphLaunch`): it runs after the work queued there
    /// before, and work queued after waits for all of it. A graph's launches on one or several
    /// streams run one after another, never overlapped.
    ///
    /// A graph ended from a capture in which tracked buffers were used
    /// ([`Graph::tracked_capture`]) is ordered with eager work on those buffers on other streams
    /// as eager work is: on an eager stream the launch first waits for the fenced eager work it
    /// conflicts with (a write of bytes the graph uses; a read of bytes it writes), and leaves a
    /// fence (one pooled event) behind itself, which later eager work on those buffers on other
    /// streams waits for ([`wait_for_graph_launches`](super::wait_for_graph_launches)). Such a
    /// graph is not launched while a host slice of memory it conflicts with is live, nor into a
    /// capture. Other graphs' launches cost nothing more.
    ///
    /// # Errors
    /// `InvalidArgument` for a stream of another device;
    /// [`GraphError::RelaunchNeedsAutoFree`] for a second launch of a graph that allocates and
    /// was instantiated without auto-free; [`GraphError::HostBorrowed`] while the host borrows
    /// memory the graph's capture used ([`HostBorrow`](super::HostBorrow)), and
    /// [`GraphError::TrackedGraphInCapture`] for a tracked graph launched into a capture, both
    /// before anything is queued; [`GraphError::Capturing`], nothing launched, on the legacy
    /// default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](super::refuse_on_legacy_stream)); the driver's error
    /// otherwise.
    #[inline]
    pub fn launch(&self, stream: &Stream) -> Result<()> {
        stream.ensure_context(&self.context, "GraphExec::launch")?;
        super::refuse_on_legacy_stream(stream, "GraphExec::launch")?;
        let mut state = self.lock.lock();
        if self.single_launch && self.launches.load(Ordering::Relaxed) != 0 {
            return Err(GraphError::RelaunchNeedsAutoFree.into());
        }
        self.context.bind_to_thread()?;
        let api = driver()?;
        // Whether the stream is capturing, asked once, and only by launches that fence.
        let eager = (self.tracked_capture.is_some() || self.launch_fenced)
            && super::fences::is_eager(stream);
        // A tracked graph launched on an eager stream is fenced both ways. Into a capture it
        // would become a node of that graph, which neither the fences nor the buffers' graph
        // pools know: refused. Eager work on other streams that this graph's memory is ordered
        // after goes first.
        if let Some(capture) = self.tracked_capture {
            if !eager {
                return Err(GraphError::TrackedGraphInCapture { capture }.into());
            }
            super::fences::wait_for_eager_uses(stream, capture)?;
        }
        // Counted before it is enqueued, so host access to memory the graph uses waits for it,
        // and refused while such access is under way (see `launches`).
        super::launches::LAUNCHES
            .launch(self.tracked_capture, || {
                // SAFETY: live executable and stream of the same (current) context.
                unsafe { cu!(api.graph_launch(self.raw, stream.as_raw())) }
            })
            .map_err(|refused| GraphError::HostBorrowed {
                capture: refused.capture,
            })??;
        self.launches.fetch_add(1, Ordering::Relaxed);
        state.retirement.launched(|| self.fence_behind(stream));
        if self.launch_fenced
            && (!self.keep_alive.is_empty() || state.retirement.retired_len() != 0)
        {
            self.fence_last_launch(&mut state, stream, eager);
        }
        // Eager work on other streams that uses memory a capture used waits for this.
        if let Some(capture) = self.tracked_capture {
            super::fences::fence_launch(&self.context, stream, capture, || {
                self.record_behind(stream)
            });
        }
        Ok(())
    }

    /// An event recorded on `stream` now, behind a launch, or `None` when none can be (a
    /// capturing stream would record it into its graph, where it proves nothing): once per
    /// update, so the cold path.
    #[cold]
    fn fence_behind(&self, stream: &Stream) -> Option<OwnedPooledEvent> {
        if !matches!(stream.is_capturing(), Ok(false)) {
            return None;
        }
        match self.record_behind(stream) {
            Ok(event) => Some(event),
            Err(error) => {
                tracing::warn!(%error, "recording a graph's keep-alive fence failed; the old keep-alives wait for a later launch");
                None
            }
        }
    }

    /// Re-records the executable's own event behind the launch just queued on `stream`, so that
    /// a drop can tell when the values it keeps alive are no longer used. A stream that is
    /// capturing (not `eager`) gets none: the launch is a node of that capture's graph.
    fn fence_last_launch(&self, state: &mut LaunchState, stream: &Stream, eager: bool) {
        if !eager {
            return;
        }
        let recorded = match &state.behind_last {
            Some(event) => event.record(stream),
            None => Event::new(&self.context, EventFlags::DISABLE_TIMING).and_then(|event| {
                event.record(stream)?;
                state.behind_last = Some(event);
                Ok(())
            }),
        };
        if let Err(error) = recorded {
            tracing::warn!(%error, "recording a graph launch's keep-alive fence failed; its keep-alives will be leaked at drop");
            state.unfenced = true;
        }
    }

    /// An event of the context's shared pool, recorded on `stream` now (behind a launch).
    fn record_behind(&self, stream: &Stream) -> Result<OwnedPooledEvent> {
        let pool = match self.event_pool.get() {
            Some(pool) => pool,
            None => {
                let made = EventPool::for_context(&self.context)?;
                self.event_pool.get_or_init(|| made)
            }
        };
        let event = pool.acquire_owned(false)?;
        event.record(stream)?;
        Ok(event)
    }

    /// Uploads the executable's work descriptions to the device ahead of the first launch
    /// (`cuGraphUpload`), so that launch costs what later ones do. Ordered on `stream`.
    ///
    /// # Errors
    /// `InvalidArgument` for a stream of another device; [`GraphError::Capturing`] on the
    /// legacy default stream while a blocking stream of its context captures
    /// ([`refuse_on_legacy_stream`](super::refuse_on_legacy_stream)); the driver's error
    /// otherwise.
    pub fn upload(&self, stream: &Stream) -> Result<()> {
        stream.ensure_context(&self.context, "GraphExec::upload")?;
        super::refuse_on_legacy_stream(stream, "GraphExec::upload")?;
        let _guard = self.lock.lock();
        self.context.bind_to_thread()?;
        let api = driver()?;
        // Relaxed, as `instantiate`: uploading may allocate the executable's device memory.
        let _relaxed = super::relaxed_for_unrecorded_call()?;
        // SAFETY: live executable and stream of the same (current) context.
        unsafe { cu!(api.graph_upload(self.raw, stream.as_raw())) }
    }

    /// Replaces the parameters of every node with those of `graph`, which must have the same
    /// shape (same nodes and edges, same node types, kernels of the same module); typically
    /// `graph` was captured again from the same code with other addresses or scalars
    /// (`cuGraphExecUpdate`). What `graph` keeps alive is kept alive here too, and replaces
    /// the previous generation, which is dropped once the launches made before this update have
    /// finished (see [Keep-alives across updates](Self#keep-alives-across-updates)).
    ///
    /// # Errors
    /// `InvalidArgument` for a graph of another context (its nodes' addresses and kernels mean
    /// nothing in this executable's); [`GraphError::UpdateRejected`] with the driver's reason
    /// and the blocking node's type. The executable is unchanged then.
    pub fn update(&mut self, graph: &Graph) -> Result<()> {
        if graph.context().as_raw() != self.context.as_raw() {
            return Err(DriverError::invalid(
                "GraphExec::update",
                format!(
                    "the graph belongs to a context of device {}, the executable to one of device {}",
                    graph.context().device().ordinal(),
                    self.context.device().ordinal()
                ),
            ));
        }
        release_finished_keep_alives();
        // `&mut self`: no launch runs meanwhile, and the lock needs no locking.
        let retirement = &mut self.lock.get_mut().retirement;
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut info = sys::CUgraphExecUpdateResultInfo::default();
        // Relaxed, as `instantiate`.
        let _relaxed = super::relaxed_for_unrecorded_call()?;
        // SAFETY: live executable and graph; valid out-pointer.
        let outcome = unsafe { cu!(api.graph_exec_update(self.raw, graph.as_raw(), &mut info)) };
        if let Err(error) = outcome {
            if info.result != sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS {
                return Err(GraphError::UpdateRejected {
                    reason: update_result_name(info.result),
                    node_type: GraphNodeType::of(info.errorNode),
                }
                .into());
            }
            return Err(error);
        }
        retirement.update(&mut self.keep_alive, graph.kept_alive());
        // Later launches run `graph`'s parameters: they are fenced under its capture. Launches
        // made before keep their fences under the old one until those finish.
        self.tracked_capture = graph.tracked_capture();
        // Sticky: retired generations may still hold the earlier graphs' fenced values.
        self.launch_fenced |= graph.launch_fenced();
        Ok(())
    }
}

impl Drop for GraphExec {
    fn drop(&mut self) {
        let Ok(api) = driver() else { return };
        if let Err(error) = self.context.bind_to_thread() {
            tracing::warn!(%error, "binding context to destroy a graph executable failed");
            return;
        }
        // Relaxed, as `instantiate`: destroying frees the executable's device memory.
        let _relaxed = super::relaxed_for_unrecorded_call();
        // SAFETY: we own the executable and destroy it once; queued launches still complete.
        if let Err(error) = unsafe { cu!(api.graph_exec_destroy(self.raw)) } {
            tracing::warn!(%error, "destroying a graph executable failed");
        }
        self.release_keep_alives();
    }
}

impl GraphExec {
    /// At drop: the values kept alive go now when no launch may still use them, or wait for
    /// the last launch's event (see [Keep-alives after a drop](Self#keep-alives-after-a-drop)).
    fn release_keep_alives(&mut self) {
        release_finished_keep_alives();
        let state = std::mem::take(self.lock.get_mut());
        let mut values = std::mem::take(&mut self.keep_alive);
        values.extend(state.retirement.into_values());
        if values.is_empty() {
            return;
        }
        if state.unfenced {
            tracing::warn!(
                values = values.len(),
                "a launch had no keep-alive fence: leaking what the dropped graph executable kept alive"
            );
            std::mem::forget(values);
            return;
        }
        match state.behind_last {
            // Never launched on an eager stream while it held fenced values: nothing queued
            // uses them, or they wait for the device themselves.
            None => drop(values),
            Some(fence) => {
                if super::keep_alive::Fence::is_complete(&fence) {
                    drop(values);
                } else {
                    DEFERRED.lock().push(fence, values);
                }
            }
        }
    }
}

fn instantiate_result_name(result: sys::CUgraphInstantiateResult) -> &'static str {
    use sys::CUgraphInstantiateResult as R;
    match result {
        R::CUDA_GRAPH_INSTANTIATE_ERROR => "CUDA_GRAPH_INSTANTIATE_ERROR",
        R::CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE => "CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE",
        R::CUDA_GRAPH_INSTANTIATE_NODE_OPERATION_NOT_SUPPORTED => {
            "CUDA_GRAPH_INSTANTIATE_NODE_OPERATION_NOT_SUPPORTED"
        }
        R::CUDA_GRAPH_INSTANTIATE_MULTIPLE_CTXS_NOT_SUPPORTED => {
            "CUDA_GRAPH_INSTANTIATE_MULTIPLE_CTXS_NOT_SUPPORTED"
        }
        _ => "an unknown instantiate result",
    }
}

fn update_result_name(result: sys::CUgraphExecUpdateResult) -> &'static str {
    use sys::CUgraphExecUpdateResult as R;
    match result {
        R::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED => "the topology changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED => "a node's type changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_FUNCTION_CHANGED => "a kernel's function changed",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_PARAMETERS_CHANGED => {
            "parameters changed in an unsupported way"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_NOT_SUPPORTED => "the update is not supported",
        R::CU_GRAPH_EXEC_UPDATE_ERROR_UNSUPPORTED_FUNCTION_CHANGE => {
            "a kernel moved to another module or context"
        }
        R::CU_GRAPH_EXEC_UPDATE_ERROR_ATTRIBUTES_CHANGED => "node attributes changed",
        _ => "the update failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_free_on_relaunch() {
        let options = InstantiateOptions::default();
        assert!(options.auto_free_on_launch);
        assert!(!options.with_auto_free_on_launch(false).auto_free_on_launch);
        assert!(options.with_node_priority(true).use_node_priority);
    }

    #[test]
    fn results_have_names() {
        assert_eq!(
            instantiate_result_name(
                sys::CUgraphInstantiateResult::CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE
            ),
            "CUDA_GRAPH_INSTANTIATE_INVALID_STRUCTURE"
        );
        assert_eq!(
            update_result_name(
                sys::CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED
            ),
            "the topology changed"
        );
    }

    #[test]
    fn handles_are_send_and_sync() {
        fn both<T: Send + Sync>() {}
        both::<GraphExec>();
        both::<Graph>();
    }
}
