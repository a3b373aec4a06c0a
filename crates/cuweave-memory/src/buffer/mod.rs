//! buffer (in progress).
