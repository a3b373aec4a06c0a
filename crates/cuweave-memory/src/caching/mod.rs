//! caching (in progress).
