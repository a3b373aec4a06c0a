//! Transfers for cuweave: a transfer manager that moves bytes between host and devices by the
//! fastest real path.
//!
//! Work in progress (issue 8); see `ARCHITECTURE.md`.
#![forbid(unsafe_code)]
