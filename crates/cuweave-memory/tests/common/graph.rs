//! Graph fixtures shared by the memory crate's graph tests (included with `#[path]`): a
//! non-blocking stream, a graph captured after a context synchronisation, its executable, and
//! the capture a launch was refused for while the host borrowed its memory.

use std::sync::Arc;

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{
    Context, DriverError, Graph, GraphError, GraphExec, InstantiateOptions, Stream, StreamFlags,
};

/// A new non-blocking stream of `ctx`.
pub fn non_blocking(ctx: &Arc<Context>) -> Stream {
    Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap()
}

/// The graph of what `record` queues on `stream`, captured after a context synchronisation.
pub fn capture_graph(stream: &Stream, record: impl FnOnce()) -> Graph {
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    record();
    stream.end_capture().unwrap()
}

/// `graph`, instantiated with the default options.
pub fn instantiate(graph: &Graph) -> GraphExec {
    graph.instantiate(&InstantiateOptions::default()).unwrap()
}

/// The capture a launch was refused for because the host borrows memory its graph uses
/// (`GraphError::HostBorrowed`); `None` for any other outcome.
#[allow(dead_code)] // not every test binary that includes this file asks
pub fn refused_for_host_borrow(result: &cuweave_driver::Result<()>) -> Option<u64> {
    match result {
        Err(DriverError::Graph(GraphError::HostBorrowed { capture })) => Some(*capture),
        _ => None,
    }
}
