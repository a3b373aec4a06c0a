//! The process-wide caching allocator of each device (PyTorch's
//! `c10::cuda::CUDACachingAllocator`): what [`DeviceBuffer`](crate::DeviceBuffer) allocates from
//! unless told otherwise.
//!
//! One allocator per device, over `cuMemAlloc` in the device's primary context, made on first
//! use. [`CachingAllocator::set_default_for_device`] replaces it (say, by one over a
//! [`LimitAdaptor`](crate::LimitAdaptor) or an [`AsyncPoolResource`](crate::AsyncPoolResource)).
//!
//! Reaching the default must not make threads convoy: each thread keeps its own clone of the
//! allocators it used, checked against a global generation number that only a replacement
//! changes, so the hot path reads one shared word that nobody writes and touches no shared
//! reference count.

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuweave_driver::{Context, Device};
use parking_lot::Mutex;

use super::allocator::CachingAllocator;
use super::config::AllocatorConfig;
use crate::error::{MemoryError, Result};
use crate::resource::DriverResource;

/// The allocators by device ordinal.
static DEFAULTS: Mutex<Vec<Option<CachingAllocator>>> = Mutex::new(Vec::new());

/// Changed by every replacement, so that threads drop their clones of a replaced allocator.
static GENERATION: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// This thread's clones of the defaults it used, and the generation they belong to.
    static LOCAL: RefCell<(u64, Vec<Option<CachingAllocator>>)> = const { RefCell::new((0, Vec::new())) };
}

/// The default allocator of `device`, made on first use.
pub(crate) fn for_device(device: Device) -> Result<CachingAllocator> {
    let mut defaults = DEFAULTS.lock();
    let index = device.ordinal();
    if let Some(Some(allocator)) = defaults.get(index) {
        return Ok(allocator.clone());
    }
    // Retaining the primary context is a driver call, but a rare one (once per device), and
    // holding the lock keeps two threads from making two defaults.
    // `CUWEAVE_ALLOC_CONF` (PyTorch's `PYTORCH_CUDA_ALLOC_CONF`) shapes every default; a
    // setting that does not parse fails the allocation, as PyTorch's does, rather than being
    // ignored.
    let config = AllocatorConfig::from_env()?;
    let upstream = Arc::new(DriverResource::new(&Context::primary(device)?));
    let allocator = CachingAllocator::with_config(upstream, config)?;
    cuweave_driver::process_caches::register_process_cache(
        "cuweave-memory: the default caching allocators",
        empty_defaults,
    );
    if defaults.len() <= index {
        defaults.resize(index + 1, None);
    }
    defaults[index] = Some(allocator.clone());
    Ok(allocator)
}

/// Empties every device's default allocator ([`CachingAllocator::empty_cache`]); returns the
/// bytes given back. Registered with the driver's process caches
/// ([`cuweave_driver::empty_process_caches`]).
fn empty_defaults() -> usize {
    let defaults: Vec<CachingAllocator> = DEFAULTS.lock().iter().flatten().cloned().collect();
    defaults
        .iter()
        .map(|allocator| match allocator.empty_cache() {
            Ok(bytes) => bytes,
            Err(error) => {
                tracing::warn!(%error, "emptying a default caching allocator failed");
                0
            }
        })
        .sum()
}

/// Makes `allocator` the default of its device; returns the one it replaces, if any.
pub(crate) fn set_for_device(allocator: CachingAllocator) -> Option<CachingAllocator> {
    let mut defaults = DEFAULTS.lock();
    let index = allocator.device().ordinal();
    if defaults.len() <= index {
        defaults.resize(index + 1, None);
    }
    let previous = defaults[index].replace(allocator);
    GENERATION.fetch_add(1, Ordering::AcqRel);
    previous
}

/// Runs `f` with the default allocator of `device`, borrowed from this thread's clone when it
/// is current (no shared reference count is touched), else fetched and kept for next time.
///
/// `f` must not reach the default allocator again (it runs under this thread's borrow).
#[inline]
pub(crate) fn with_default<R>(
    device: Device,
    f: impl FnOnce(&CachingAllocator) -> Result<R>,
) -> Result<R> {
    let generation = GENERATION.load(Ordering::Acquire);
    let index = device.ordinal();
    let mut f = Some(f);
    let local = LOCAL.try_with(|local| {
        let mut local = local.try_borrow_mut().ok()?;
        if local.0 != generation {
            local.1.clear();
            local.0 = generation;
        }
        match (local.1.get(index), f.take()) {
            (Some(Some(allocator)), Some(f)) => Some(f(allocator)),
            (_, taken) => {
                f = taken;
                None
            }
        }
    });
    if let Ok(Some(result)) = local {
        return result;
    }
    let allocator = for_device(device)?;
    // Keep a clone for this thread (skipped while the thread is being torn down).
    let _ = LOCAL.try_with(|local| {
        if let Ok(mut local) = local.try_borrow_mut()
            && local.0 == generation
        {
            if local.1.len() <= index {
                local.1.resize(index + 1, None);
            }
            local.1[index] = Some(allocator.clone());
        }
    });
    match f {
        Some(f) => f(&allocator),
        None => Err(MemoryError::InvalidStream {
            operation: "default allocator",
            reason: "re-entered",
        }),
    }
}

/// `Err(WrongContext)` unless `context` is the one `allocator` allocates in.
pub(crate) fn check_context(
    allocator: &CachingAllocator,
    context: &Context,
    operation: &'static str,
) -> Result<()> {
    if allocator.upstream().context().as_raw() == context.as_raw() {
        Ok(())
    } else {
        Err(MemoryError::WrongContext {
            operation,
            device: context.device().ordinal(),
        })
    }
}
