//! Raw memory: device, pinned-host and managed allocations, copies, memsets, stream-ordered
//! pools, and the unified-memory advice, prefetch and range queries.
//!
//! The allocation types own their memory and free it on drop. Copies, memsets, advice and
//! prefetch take raw pointers, so they are `unsafe fn`s with their contracts written down:
//! `cuweave-memory` builds the typed, safe buffers on top of them.

mod address_range;
mod completion_words;
mod copy;
mod device_alloc;
mod device_free;
mod host;
mod host_retirement;
mod managed;
mod mapped_words;
mod pointer;
mod pool;
mod stream_marks;
mod word_claims;

pub use address_range::address_range;
pub use completion_words::CompletionWords;
pub use copy::{
    copy, copy_async, copy_dtod, copy_dtod_async, copy_dtoh, copy_dtoh_async, copy_htod,
    copy_htod_async, copy_peer_async, memset_d8, memset_d8_async, memset_d16, memset_d16_async,
    memset_d32, memset_d32_async,
};
pub use device_alloc::{DeviceAllocation, alloc_async, free_async};
pub use host::{HostAllocFlags, HostAllocation, HostRegistration};
pub use host_retirement::{MOST_SPARE_WORD_BYTES, host_allocations_awaiting_free};
pub use managed::{
    Advice, ManagedAllocation, MemLocation, PrefetchRange, advise, prefetch_async,
    prefetch_batch_async, range_accessed_by, range_attribute, range_last_prefetch_location,
    range_preferred_location, range_read_mostly,
};
pub use mapped_words::MappedWords;
pub use pointer::{MemoryType, PointerAttributes, pointer_attributes};
pub use pool::MemoryPool;
pub use stream_marks::{Mark, StreamMarks};

/// A device address (`CUdeviceptr`).
pub type DevicePtr = crate::sys::CUdeviceptr;

use crate::error::{DriverError, Result};

/// Frees memory from `cuMemAlloc` or `cuMemAllocManaged` with `cuMemFree` (which waits for the
/// device first).
///
/// # Safety
/// `ptr` must be a live allocation of `context` that the caller owns and frees exactly once.
pub(crate) unsafe fn free_device_memory(context: &crate::Context, ptr: DevicePtr) -> Result<()> {
    context.bind_to_thread()?;
    let api = crate::loader::driver()?;
    // A capture records no free: made in relaxed mode, it leaves an active capture intact.
    let _relaxed = crate::graph::relaxed_for_unrecorded_call()?;
    // SAFETY: the caller's contract.
    unsafe { crate::loader::cu!(api.mem_free(ptr)) }
}

/// An error for a zero-byte request, which every driver allocation rejects.
pub(crate) fn nonzero(bytes: usize, operation: &'static str) -> Result<()> {
    if bytes == 0 {
        Err(DriverError::invalid(operation, "zero-byte request"))
    } else {
        Ok(())
    }
}
