//! resource (in progress).
