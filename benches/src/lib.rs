//! Shared helpers for the cuweave benchmarks (in progress).
