//! Streams for cuweave: priority streams, stream pools, multi-stream coordination, a
//! stream-ordered allocator and a GPU-timed profiler.
//!
//! Work in progress (issue 6); see `ARCHITECTURE.md`.
#![forbid(unsafe_code)]
