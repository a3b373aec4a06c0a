//! [`PinnedPoolConfig`]: how a [`PinnedPool`](super::PinnedPool) pins and how much it keeps.

use cuweave_driver::memory::HostAllocFlags;

/// Options for [`PinnedPool::with_config`](super::PinnedPool::with_config).
///
/// Build one from [`Default`] and change what you need:
///
/// ```
/// use cuweave_memory::pinned_pool::PinnedPoolConfig;
///
/// let config = PinnedPoolConfig { mapped: true, ..PinnedPoolConfig::default() };
/// assert_eq!(config.max_cached_bytes, PinnedPoolConfig::DEFAULT_MAX_CACHED_BYTES);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedPoolConfig {
    /// The most bytes of returned blocks kept for reuse. A block that becomes ready for reuse
    /// while the cache is full is given back to the driver instead. Blocks whose last use is
    /// still running on the GPU are kept regardless (they cannot be freed yet), so the cache may
    /// exceed this while they are pending.
    pub max_cached_bytes: usize,
    /// Pin blocks mapped into the device address space (`CU_MEMHOSTALLOC_DEVICEMAP`), so kernels
    /// can read and write them directly through [`PinnedBlock::device_ptr`](super::PinnedBlock::device_ptr).
    pub mapped: bool,
    /// Pin blocks write-combined: faster host writes and device reads, very slow host reads. Only
    /// for pools that stage uploads.
    pub write_combined: bool,
}

impl PinnedPoolConfig {
    /// The default cap on cached bytes: 1 GiB.
    pub const DEFAULT_MAX_CACHED_BYTES: usize = 1 << 30;

    /// The driver flags blocks are pinned with: always portable, so every context can use them.
    pub(crate) fn host_alloc_flags(&self) -> HostAllocFlags {
        HostAllocFlags {
            portable: true,
            device_map: self.mapped,
            write_combined: self.write_combined,
        }
    }
}

impl Default for PinnedPoolConfig {
    fn default() -> Self {
        Self {
            max_cached_bytes: Self::DEFAULT_MAX_CACHED_BYTES,
            mapped: false,
            write_combined: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_always_portable_and_mapped_only_on_request() {
        let plain = PinnedPoolConfig::default().host_alloc_flags();
        assert!(plain.portable && !plain.device_map && !plain.write_combined);
        let mapped = PinnedPoolConfig {
            mapped: true,
            write_combined: true,
            ..PinnedPoolConfig::default()
        }
        .host_alloc_flags();
        assert!(mapped.portable && mapped.device_map && mapped.write_combined);
    }
}
