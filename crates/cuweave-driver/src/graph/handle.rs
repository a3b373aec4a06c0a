//! [`Graph`]: a recorded graph of device work, before instantiation.

use std::any::Any;
use std::ffi::CString;
use std::path::Path;
use std::sync::Arc;

use parking_lot::Mutex;

use super::exec::{GraphExec, InstantiateOptions};
use crate::context::Context;
use crate::error::{DriverError, Result};
use crate::loader::{cu, driver};
use crate::sys;

/// Something a graph keeps alive for as long as it, or an executable made from it, exists: the
/// memory pool its allocations came from, buffers its nodes read. Dropped with the last holder.
pub type KeepAlive = Arc<dyn Any + Send + Sync>;

/// A [`KeepAlive`] whose drop waits for the device itself before it frees or reuses anything
/// a graph may use, for [`Graph::keep_alive_synchronizing`]: an executable dropped with launches
/// queued need not fence them for it.
#[derive(Clone)]
pub struct SynchronizingKeepAlive(KeepAlive);

impl SynchronizingKeepAlive {
    /// Wraps `value`.
    ///
    /// # Safety
    /// Dropping the last clone of `value`, and everything it then releases, frees or hands out
    /// for reuse nothing that queued device work may still use before that work has finished
    /// (for instance: it synchronises the context first). An executable holding it drops it
    /// without waiting for its own queued launches.
    pub unsafe fn new(value: KeepAlive) -> Self {
        Self(value)
    }
}

impl std::fmt::Debug for SynchronizingKeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SynchronizingKeepAlive")
    }
}

/// The kind of a graph node (`CUgraphNodeType`), as far as cuweave distinguishes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GraphNodeType {
    /// A kernel launch.
    Kernel,
    /// A memory copy.
    Memcpy,
    /// A memset.
    Memset,
    /// A host function.
    Host,
    /// A child graph.
    Graph,
    /// No operation (a join point).
    Empty,
    /// Waits for an event.
    WaitEvent,
    /// Records an event.
    EventRecord,
    /// A memory allocation from the graph's memory pool (`cuMemAllocAsync` in a capture).
    MemAlloc,
    /// A memory free (`cuMemFreeAsync` in a capture).
    MemFree,
    /// Any other node type (external semaphores, batch memory operations, conditionals, ...).
    Other(u32),
}

impl GraphNodeType {
    fn from_sys(node_type: sys::CUgraphNodeType) -> Self {
        use sys::CUgraphNodeType as T;
        match node_type {
            T::CU_GRAPH_NODE_TYPE_KERNEL => Self::Kernel,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => Self::Memcpy,
            T::CU_GRAPH_NODE_TYPE_MEMSET => Self::Memset,
            T::CU_GRAPH_NODE_TYPE_HOST => Self::Host,
            T::CU_GRAPH_NODE_TYPE_GRAPH => Self::Graph,
            T::CU_GRAPH_NODE_TYPE_EMPTY => Self::Empty,
            T::CU_GRAPH_NODE_TYPE_WAIT_EVENT => Self::WaitEvent,
            T::CU_GRAPH_NODE_TYPE_EVENT_RECORD => Self::EventRecord,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC => Self::MemAlloc,
            T::CU_GRAPH_NODE_TYPE_MEM_FREE => Self::MemFree,
            other => Self::Other(other.0),
        }
    }

    /// The type of `node`, when the driver can tell.
    pub(crate) fn of(node: sys::CUgraphNode) -> Option<Self> {
        if node.is_null() {
            return None;
        }
        let api = driver().ok()?;
        let mut node_type = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node handle the driver just reported; valid out-pointer.
        unsafe { cu!(api.graph_node_get_type(node, &mut node_type)) }.ok()?;
        Some(Self::from_sys(node_type))
    }
}

/// A graph of device work: what a stream capture recorded ([`Stream::end_capture`]), or a graph
/// another library built. Destroyed on drop (instantiated executables stay valid).
///
/// `Send + Sync`: the driver does not synchronise access to one graph, so every call on it is
/// serialised by a lock held by the handle.
///
/// [`Stream::end_capture`]: crate::Stream::end_capture
pub struct Graph {
    context: Arc<Context>,
    raw: sys::CUgraph,
    /// Serialises driver calls on `raw`.
    lock: Mutex<()>,
    keep_alive: Vec<KeepAlive>,
    /// A value given to [`keep_alive`](Self::keep_alive) (not
    /// [`keep_alive_synchronizing`](Self::keep_alive_synchronizing)): executables fence their
    /// launches for it (see [`GraphExec`]'s keep-alives after a drop).
    launch_fenced: bool,
    /// The capture the graph came from, when a tracked buffer was used in it: its executables'
    /// launches leave fences for eager work on other streams (see `fences`).
    tracked_capture: Option<u64>,
}

// SAFETY: a CUgraph may be used from any thread; concurrent calls are serialised by `lock`.
unsafe impl Send for Graph {}
// SAFETY: as above: every method that touches `raw` holds `lock`.
unsafe impl Sync for Graph {}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph")
            .field("raw", &self.raw)
            .field("device", &self.context.device().ordinal())
            .field("keep_alive", &self.keep_alive.len())
            .finish()
    }
}

impl Graph {
    /// Wraps a graph handle, destroying it on drop.
    ///
    /// # Safety
    /// `raw` is a live graph of `context` that nobody else destroys.
    pub unsafe fn from_raw(context: &Arc<Context>, raw: sys::CUgraph) -> Self {
        Self {
            context: Arc::clone(context),
            raw,
            lock: Mutex::new(()),
            keep_alive: Vec::new(),
            launch_fenced: false,
            tracked_capture: None,
        }
    }

    /// The same graph, marked as ended from capture `capture` in which tracked buffers were
    /// used (`None`: none were).
    pub(crate) fn with_tracked_capture(mut self, capture: Option<u64>) -> Self {
        self.tracked_capture = capture;
        self
    }

    /// The capture the graph ended from, when tracked buffers (of the memory layer) were used
    /// in it: the executables' launches then leave fences that eager work on those buffers on
    /// other streams waits for.
    pub fn tracked_capture(&self) -> Option<u64> {
        self.tracked_capture
    }

    /// The raw `CUgraph` (still owned by this handle).
    pub fn as_raw(&self) -> sys::CUgraph {
        self.raw
    }

    /// The context the graph belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Keeps `value` alive as long as this graph and every executable instantiated from it
    /// afterwards (a memory pool its allocations came from, buffers its nodes use).
    ///
    /// Dropping an executable does not wait for its queued launches, so while it keeps such
    /// values alive each of its launches re-records an event behind itself (one `cuEventRecord`),
    /// which a dropped executable's values wait for.
    pub fn keep_alive(&mut self, value: KeepAlive) {
        self.keep_alive.push(value);
        self.launch_fenced = true;
    }

    /// [`keep_alive`](Self::keep_alive) for a value whose own drop waits for the device before
    /// it releases anything (the memory layer's graph pools: their memory goes back only after
    /// their context synchronised), so launches need record nothing for it: kept alive the same
    /// way, at no cost per launch. The promise is made where the value is wrapped
    /// ([`SynchronizingKeepAlive::new`], `unsafe`).
    pub fn keep_alive_synchronizing(&mut self, value: SynchronizingKeepAlive) {
        self.keep_alive.push(value.0);
    }

    /// Whether a value was given to [`keep_alive`](Self::keep_alive), so that launches of its
    /// executables are fenced.
    pub(super) fn launch_fenced(&self) -> bool {
        self.launch_fenced
    }

    /// What the graph keeps alive.
    pub fn kept_alive(&self) -> &[KeepAlive] {
        &self.keep_alive
    }

    /// The type of every node (`cuGraphGetNodes`, `cuGraphNodeGetType`).
    pub fn node_types(&self) -> Result<Vec<GraphNodeType>> {
        let _guard = self.lock.lock();
        self.context.bind_to_thread()?;
        let api = driver()?;
        let mut count = 0usize;
        // SAFETY: live graph; a null array asks for the count.
        unsafe { cu!(api.graph_get_nodes(self.raw, std::ptr::null_mut(), &mut count)) }?;
        if count == 0 {
            // An empty graph (a capture that recorded nothing): the driver refuses an array
            // with no room in it (`CUDA_ERROR_INVALID_VALUE`), so do not ask again.
            return Ok(Vec::new());
        }
        let mut nodes = vec![std::ptr::null_mut(); count];
        // SAFETY: `nodes` holds `count` slots.
        unsafe { cu!(api.graph_get_nodes(self.raw, nodes.as_mut_ptr(), &mut count)) }?;
        nodes.truncate(count);
        nodes
            .into_iter()
            .map(|node| {
                let mut node_type = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
                // SAFETY: a node of this live graph; valid out-pointer.
                unsafe { cu!(api.graph_node_get_type(node, &mut node_type)) }?;
                Ok(GraphNodeType::from_sys(node_type))
            })
            .collect()
    }

    /// How many nodes the graph has.
    pub fn node_count(&self) -> Result<usize> {
        Ok(self.node_types()?.len())
    }

    /// Whether the graph allocates memory (has `MemAlloc` nodes: `cuMemAllocAsync` captured).
    pub fn allocates_memory(&self) -> Result<bool> {
        Ok(self.node_types()?.contains(&GraphNodeType::MemAlloc))
    }

    /// Instantiates the graph into an executable (`cuGraphInstantiateWithParams`).
    ///
    /// A graph that allocates memory is instantiated with `AUTO_FREE_ON_LAUNCH` unless
    /// `options` turn it off, so that it can be launched again before its allocations are
    /// freed; without it, a second launch is refused with
    /// [`GraphError::RelaunchNeedsAutoFree`](super::GraphError::RelaunchNeedsAutoFree).
    ///
    /// # Errors
    /// [`GraphError::Instantiate`](super::GraphError::Instantiate) with the driver's reason and
    /// the type of the node that failed; the driver's error otherwise.
    pub fn instantiate(&self, options: &InstantiateOptions) -> Result<GraphExec> {
        let allocates = self.allocates_memory()?;
        let _guard = self.lock.lock();
        GraphExec::instantiate(
            &self.context,
            self.raw,
            options,
            allocates,
            self.keep_alive.clone(),
            self.launch_fenced,
            self.tracked_capture,
        )
    }

    /// Writes the graph as Graphviz DOT to `path` (`cuGraphDebugDotPrint`); `verbose` adds
    /// every node's parameters.
    pub fn write_dot(&self, path: &Path, verbose: bool) -> Result<()> {
        let text = path.to_str().ok_or_else(|| {
            DriverError::invalid(
                "Graph::write_dot",
                format!("{} is not UTF-8", path.display()),
            )
        })?;
        let path = CString::new(text).map_err(|_| {
            DriverError::invalid("Graph::write_dot", format!("{text:?} contains a NUL byte"))
        })?;
        let flags = if verbose {
            sys::CUgraphDebugDot_flags::CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE.0
        } else {
            0
        };
        let _guard = self.lock.lock();
        self.context.bind_to_thread()?;
        let api = driver()?;
        // SAFETY: live graph; NUL-terminated path.
        unsafe { cu!(api.graph_debug_dot_print(self.raw, path.as_ptr(), flags)) }
    }

    /// The graph as Graphviz DOT text (written to a temporary file and read back).
    pub fn to_dot(&self, verbose: bool) -> Result<String> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "cuweave-graph-{}-{}.dot",
            std::process::id(),
            SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        self.write_dot(&path, verbose)?;
        let text = std::fs::read_to_string(&path).map_err(|error| {
            DriverError::invalid(
                "Graph::to_dot",
                format!("reading {}: {error}", path.display()),
            )
        });
        let _ = std::fs::remove_file(&path);
        text
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        let Ok(api) = driver() else { return };
        if let Err(error) = self.context.bind_to_thread() {
            tracing::warn!(%error, "binding context to destroy a graph failed");
            return;
        }
        // Relaxed: a graph may be dropped while another thread captures in global mode (see
        // `GraphExec`'s instantiation).
        let _relaxed = super::relaxed_for_unrecorded_call();
        // SAFETY: we own the graph and destroy it once.
        if let Err(error) = unsafe { cu!(api.graph_destroy(self.raw)) } {
            tracing::warn!(%error, "destroying a graph failed");
        }
    }
}
