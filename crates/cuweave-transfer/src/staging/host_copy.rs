//! [`HostCopy`]: how a participant copies a chunk between the caller's memory and its pinned
//! block.

use cuweave_memory::{Element, copy_streaming};
use serde::{Deserialize, Serialize};

use super::switches::plain_copy;
use crate::error::Result;

/// How a participant copies a chunk between user memory and its pinned block.
///
/// Which one wins depends on the direction and on the host's last-level cache, so it is part of
/// the swept and calibrated configuration: on the H100 host (300 MiB of L3) large uploads ran at
/// 51 GB/s with [`Cached`](Self::Cached) stores, where the copy engine reads the chunk back from
/// the cache, against 43 GB/s with streaming stores, which send every chunk through DRAM first;
/// downloads, which write the caller's memory, are faster with [`Streaming`](Self::Streaming).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum HostCopy {
    /// Non-temporal stores ([`copy_streaming`]): the destination's lines are written without
    /// being read first and bypass the caches.
    #[default]
    Streaming,
    /// A plain `memcpy`: the destination's lines go through the caches.
    Cached,
}

impl HostCopy {
    /// Copies `src` into `dst` (equal lengths) this way; `CUWEAVE_STAGING_PLAIN_COPY` in the
    /// environment forces [`Cached`](Self::Cached) (for sweeps).
    pub(crate) fn copy<T: Element>(self, dst: &mut [T], src: &[T]) -> Result<()> {
        if self == Self::Cached || plain_copy() {
            dst.copy_from_slice(src);
        } else {
            copy_streaming(dst, src)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::staging::{ChunkOrder, StagingConfig};

    #[test]
    fn both_host_copies_move_the_bytes_and_old_configurations_default_to_streaming() {
        let src: Vec<u32> = (0..10_000).collect();
        for way in [HostCopy::Streaming, HostCopy::Cached] {
            let mut dst = vec![0u32; src.len()];
            way.copy(&mut dst, &src).unwrap();
            assert_eq!(dst, src);
        }
        let old = r#"{"chunk_bytes":1048576,"depth":2,"threads":4}"#;
        let config: StagingConfig = serde_json::from_str(old).unwrap();
        assert_eq!(config.host_copy, HostCopy::Streaming);
        assert_eq!(config.order, ChunkOrder::Ordered);
        assert_eq!(config.chunk_bytes, 1 << 20);
    }
}
