//! Typed GPU memory for cuweave: buffers, unified-memory hints, a caching allocator, a pinned pool.
#![forbid(unsafe_code)]

pub mod buffer;
pub mod caching;
pub mod element;
pub mod error;
pub mod pinned_pool;
pub mod resource;
pub mod unified;

pub use element::Element;
pub use error::{MemoryError, Result};
