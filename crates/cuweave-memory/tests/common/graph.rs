//! Graph fixtures shared by the memory crate's graph tests (included with `#[path]`): a
//! non-blocking stream, a graph captured after a context synchronisation, and its executable.

use std::sync::Arc;

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::{Context, Graph, GraphExec, InstantiateOptions, Stream, StreamFlags};

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
