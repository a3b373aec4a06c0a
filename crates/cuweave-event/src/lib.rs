//! Events for cuweave: an event pool, dependency-aware operation coordination, cross-stream
//! barriers and runtime-agnostic async waiting.
//!
//! Work in progress (issue 7); see `ARCHITECTURE.md`.
#![forbid(unsafe_code)]
