//! [`StreamOrderedAllocatorConfig`]: the settings of a
//! [`StreamOrderedAllocator`](super::StreamOrderedAllocator).

use serde::{Deserialize, Serialize};

/// Settings of a [`StreamOrderedAllocator`](super::StreamOrderedAllocator).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StreamOrderedAllocatorConfig {
    /// Bytes each device's pool keeps cached across synchronisations before the driver releases
    /// memory back to the OS (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`).
    pub release_threshold: u64,
}

impl Default for StreamOrderedAllocatorConfig {
    fn default() -> Self {
        Self {
            release_threshold: 256 << 20,
        }
    }
}

impl StreamOrderedAllocatorConfig {
    /// The default settings with `bytes` as the release threshold.
    pub fn with_release_threshold(bytes: u64) -> Self {
        Self {
            release_threshold: bytes,
        }
    }
}
