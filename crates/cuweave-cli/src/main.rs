//! The `cuweave` command (in progress).
#![forbid(unsafe_code)]
fn main() {}
