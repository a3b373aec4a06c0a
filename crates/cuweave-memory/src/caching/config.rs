//! [`AllocatorConfig`]: the settings PyTorch users give its caching allocator through
//! `PYTORCH_CUDA_ALLOC_CONF` and `torch.cuda.set_per_process_memory_fraction`, for
//! [`CachingAllocator::with_config`](super::CachingAllocator::with_config) and, through the
//! `CUWEAVE_ALLOC_CONF` environment variable, for each device's default allocator.
//!
//! | PyTorch | here | effect |
//! |---|---|---|
//! | `max_split_size_mb:N` | [`max_split_size`](AllocatorConfig::max_split_size) | blocks of at least N MiB are never split, and smaller requests never take them |
//! | `set_per_process_memory_fraction(f)` | [`memory_fraction`](AllocatorConfig::memory_fraction) (`memory_fraction:f` in the variable) | the allocator reserves at most `f` of the device's memory |
//!
//! Other PyTorch options (`expandable_segments`, `garbage_collection_threshold`,
//! `roundup_power2_divisions`, ...) are refused by name with
//! [`MemoryError::InvalidConfig`], so a setting copied from a PyTorch job never silently does
//! nothing.

use crate::caching::size_class::LARGE_SEGMENT;
use crate::error::{MemoryError, Result};

const MIB: usize = 1 << 20;

/// The environment variable each device's default caching allocator reads its
/// [`AllocatorConfig`] from, in `PYTORCH_CUDA_ALLOC_CONF`'s syntax
/// (`max_split_size_mb:128,memory_fraction:0.5`).
pub const ALLOC_CONF_VAR: &str = "CUWEAVE_ALLOC_CONF";

/// Settings of a [`CachingAllocator`](super::CachingAllocator); the default is PyTorch's
/// (no split limit, no memory cap).
///
/// ```
/// use cuweave_memory::caching::AllocatorConfig;
///
/// let config: AllocatorConfig = "max_split_size_mb:128,memory_fraction:0.5".parse().unwrap();
/// assert_eq!(config.max_split_size, Some(128 << 20));
/// assert_eq!(config.memory_fraction, Some(0.5));
/// assert!("expandable_segments:True".parse::<AllocatorConfig>().is_err());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct AllocatorConfig {
    /// PyTorch's `max_split_size_mb`, in bytes: a free block of at least this size is never
    /// split to serve a smaller request, and a request of at least this size takes a cached block
    /// only when that block is at most 20 MiB larger, whole. Large requests then stop carving up
    /// the cache that smaller ones need (fragmentation). At least 20 MiB (PyTorch's floor);
    /// `None`: no limit.
    pub max_split_size: Option<usize>,
    /// PyTorch's `set_per_process_memory_fraction`: the allocator reserves at most this fraction
    /// of the device's total memory (through a [`LimitAdaptor`](crate::LimitAdaptor) over its
    /// upstream); past it a request fails with
    /// [`MemoryError::OutOfMemory`] after the cache was released and the request retried. In
    /// `(0, 1]`; `None`: no cap.
    pub memory_fraction: Option<f64>,
}

impl AllocatorConfig {
    /// The configuration with blocks of at least `bytes` never split (PyTorch's
    /// `max_split_size_mb`, in bytes).
    pub fn with_max_split_size(self, bytes: usize) -> Self {
        Self {
            max_split_size: Some(bytes),
            ..self
        }
    }

    /// The configuration with reservations capped at `fraction` of the device's memory.
    pub fn with_memory_fraction(self, fraction: f64) -> Self {
        Self {
            memory_fraction: Some(fraction),
            ..self
        }
    }

    /// Checks every setting's range.
    ///
    /// # Errors
    /// [`MemoryError::InvalidConfig`] naming the setting and its allowed range.
    pub fn validate(&self) -> Result<()> {
        if let Some(bytes) = self.max_split_size
            && bytes <= LARGE_SEGMENT
        {
            return Err(invalid(
                "max_split_size",
                format!(
                    "{bytes} bytes: must be more than {} MiB (PyTorch's floor: a smaller limit \
                     would leave large segments unsplittable for every request)",
                    LARGE_SEGMENT / MIB
                ),
            ));
        }
        if let Some(fraction) = self.memory_fraction
            && !(fraction > 0.0 && fraction <= 1.0)
        {
            return Err(invalid(
                "memory_fraction",
                format!("{fraction}: must be in (0, 1]"),
            ));
        }
        Ok(())
    }

    /// The configuration in [`ALLOC_CONF_VAR`], or the default when it is unset or empty.
    ///
    /// # Errors
    /// [`MemoryError::InvalidConfig`] when it is set but does not parse.
    pub fn from_env() -> Result<Self> {
        match std::env::var(ALLOC_CONF_VAR) {
            Ok(text) => text.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Self::default()),
            Err(std::env::VarError::NotUnicode(_)) => {
                Err(invalid(ALLOC_CONF_VAR, "not valid Unicode".to_owned()))
            }
        }
    }

    /// The bytes a memory fraction leaves of `total` device memory (at least one byte).
    pub(crate) fn cap_of(fraction: f64, total: usize) -> usize {
        ((total as f64 * fraction) as usize).max(1)
    }
}

impl std::str::FromStr for AllocatorConfig {
    type Err = MemoryError;

    /// Parses `key:value` pairs separated by commas (spaces around either ignored), PyTorch's syntax:
    /// `max_split_size_mb:N` (MiB) and `memory_fraction:F`. Empty text is the default.
    fn from_str(text: &str) -> Result<Self> {
        let mut config = Self::default();
        for option in text
            .split(',')
            .map(str::trim)
            .filter(|option| !option.is_empty())
        {
            let Some((key, value)) = option.split_once(':') else {
                return Err(invalid(option, "expected key:value".to_owned()));
            };
            let (key, value) = (key.trim(), value.trim());
            match key {
                "max_split_size_mb" => {
                    let mib: usize = value.parse().map_err(|_| {
                        invalid(key, format!("{value:?} is not a whole number of MiB"))
                    })?;
                    let bytes = mib
                        .checked_mul(MIB)
                        .ok_or_else(|| invalid(key, format!("{mib} MiB overflows")))?;
                    config.max_split_size = Some(bytes);
                }
                "memory_fraction" | "per_process_memory_fraction" => {
                    let fraction: f64 = value
                        .parse()
                        .map_err(|_| invalid(key, format!("{value:?} is not a number")))?;
                    config.memory_fraction = Some(fraction);
                }
                "expandable_segments"
                | "garbage_collection_threshold"
                | "roundup_power2_divisions"
                | "max_non_split_rounding_mb"
                | "backend"
                | "release_lock_on_cudamalloc"
                | "pinned_use_cuda_host_register"
                | "pinned_num_register_threads"
                | "pinned_use_background_threads" => {
                    return Err(invalid(
                        key,
                        "a PyTorch option cuweave's caching allocator does not implement \
                         (supported: max_split_size_mb, memory_fraction)"
                            .to_owned(),
                    ));
                }
                _ => {
                    return Err(invalid(
                        key,
                        "unknown option (supported: max_split_size_mb, memory_fraction)".to_owned(),
                    ));
                }
            }
        }
        config.validate()?;
        Ok(config)
    }
}

fn invalid(option: &str, reason: String) -> MemoryError {
    MemoryError::InvalidConfig {
        option: option.to_owned(),
        reason,
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case("", AllocatorConfig::default())]
    #[case("max_split_size_mb:128", AllocatorConfig::default().with_max_split_size(128 * MIB))]
    #[case(
        " max_split_size_mb : 64 , memory_fraction:0.25 ",
        AllocatorConfig::default().with_max_split_size(64 * MIB).with_memory_fraction(0.25)
    )]
    #[case("memory_fraction:1", AllocatorConfig::default().with_memory_fraction(1.0))]
    fn parses_pytorch_syntax(#[case] text: &str, #[case] expected: AllocatorConfig) {
        assert_eq!(text.parse::<AllocatorConfig>().unwrap(), expected);
    }

    #[rstest]
    #[case("max_split_size_mb:20", "max_split_size")]
    #[case("max_split_size_mb:-3", "max_split_size_mb")]
    #[case("max_split_size_mb:lots", "max_split_size_mb")]
    #[case("memory_fraction:0", "memory_fraction")]
    #[case("memory_fraction:1.5", "memory_fraction")]
    #[case("memory_fraction:NaN", "memory_fraction")]
    #[case("expandable_segments:True", "expandable_segments")]
    #[case("garbage_collection_threshold:0.6", "garbage_collection_threshold")]
    #[case("max_split_size_mb", "max_split_size_mb")]
    #[case("colour:blue", "colour")]
    fn refuses_what_it_cannot_do_by_name(#[case] text: &str, #[case] option: &str) {
        match text.parse::<AllocatorConfig>() {
            Err(MemoryError::InvalidConfig { option: named, .. }) => assert_eq!(named, option),
            other => panic!("{text}: {other:?}"),
        }
    }

    #[test]
    fn a_fraction_caps_at_a_whole_byte_count() {
        assert_eq!(AllocatorConfig::cap_of(0.5, 80 << 30), 40 << 30);
        assert_eq!(AllocatorConfig::cap_of(1e-30, 1 << 30), 1);
    }
}
