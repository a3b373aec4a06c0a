//! Memory resources: where device memory comes from, composed RMM-style from a base resource and
//! adaptors around it.
//!
//! A [`MemoryResource`] allocates and frees device memory ordered on a stream. The base resources
//! call the driver:
//!
//! | resource | memory from | freed |
//! |---|---|---|
//! | [`DriverResource`] | `cuMemAlloc` | `cuMemFree` (waits for the device) |
//! | [`AsyncPoolResource`] | `cuMemAllocFromPoolAsync` on a private pool that keeps its memory | `cuMemFreeAsync`, in stream order; back to the driver on [`MemoryResource::release_unused`] |
//!
//! Adaptors wrap any resource (a concrete one, or an `Arc<dyn MemoryResource>`) and add one
//! behaviour: [`StatisticsAdaptor`] counts, [`LimitAdaptor`] caps the bytes outstanding,
//! [`TrackingAdaptor`] books each outstanding allocation with where it was made,
//! [`LoggingAdaptor`] writes a CSV line per allocation and free. The
//! [`CachingAllocator`](crate::caching::CachingAllocator) takes any resource as its upstream,
//! and is one itself through [`CachingResource`], so adaptors fit over the cache as well as
//! under it: `StatisticsAdaptor::new(LimitAdaptor::new(CachingResource::new(allocator), cap))`
//! counts and caps what the program holds, RMM's usual shape.
//!
//! Every resource checks its input: a zero-byte request is [`MemoryError::ZeroLength`], a stream
//! of another device [`MemoryError::WrongDevice`], and a pointer it did not hand out (or already
//! took back) [`MemoryError::UnknownAllocation`], so nothing is ever freed twice.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::resource::{DriverResource, LimitAdaptor, MemoryResource, StatisticsAdaptor};
//!
//! # fn main() -> cuweave_memory::Result<()> {
//! let context = Context::primary(Device::get(0)?)?;
//! let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
//! let resource = StatisticsAdaptor::new(LimitAdaptor::new(DriverResource::new(&context), 1 << 30));
//! let ptr = resource.allocate(1 << 20, &stream)?;
//! resource.deallocate(ptr, 1 << 20, &stream)?;
//! assert_eq!(resource.stats().total_allocations, 1);
//! # Ok(())
//! # }
//! ```

use std::sync::Arc;

use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{Context, Device, Stream};

use crate::error::{MemoryError, Result};

/// The [`MemoryResource`] methods an adaptor takes from its `upstream` field as they are (graph
/// allocation, context, device, release) and its `name` field: what every adaptor shares, so
/// that each spells out only the calls it changes.
macro_rules! forward_to_upstream {
    () => {
        fn allocates_in_graphs(&self) -> bool {
            self.upstream.allocates_in_graphs()
        }

        fn context(&self) -> &std::sync::Arc<cuweave_driver::Context> {
            self.upstream.context()
        }

        fn device(&self) -> cuweave_driver::Device {
            self.upstream.device()
        }

        fn name(&self) -> &str {
            &self.name
        }

        fn release_unused(&self) -> crate::error::Result<()> {
            self.upstream.release_unused()
        }
    };
}
use forward_to_upstream;

mod async_pool;
mod driver;
mod limit;
mod live;
mod logging;
mod statistics;
mod tracking;

pub use crate::caching::CachingResource;
pub use async_pool::AsyncPoolResource;
pub use driver::DriverResource;
pub use limit::LimitAdaptor;
pub(crate) use live::LiveAllocations;
pub use logging::{LOG_HEADER, LoggingAdaptor};
pub use statistics::{ResourceStats, StatisticsAdaptor};
pub use tracking::{OutstandingAllocation, TrackingAdaptor};

/// A source of device memory whose allocations and frees are ordered on streams (RMM's
/// `device_memory_resource`).
///
/// `allocate` returns memory that work queued on `stream` after the call may use; `deallocate`
/// returns it once the work queued on `stream` before the call has finished with it. Using the
/// memory on another stream needs that stream ordered in between (an event wait), as with any
/// stream-ordered allocation.
///
/// Object safe and `Send + Sync`: `Arc<dyn MemoryResource>` is the common currency, and adaptors
/// accept it as their upstream.
///
/// # Safety
///
/// Typed buffers ([`DeviceBuffer::with_resource`](crate::DeviceBuffer::with_resource)) and the
/// [`CachingAllocator`](crate::CachingAllocator) build safe objects on the addresses a resource
/// hands out, so, as with [`std::alloc::GlobalAlloc`], the trait is `unsafe` to implement. An
/// implementation must:
///
/// - return from [`allocate`](Self::allocate) and [`allocate_owned`](Self::allocate_owned) the
///   address of at least `bytes` bytes of device memory of [`device`](Self::device), usable from
///   [`context`](Self::context), that nothing else uses (no other live allocation of this or any
///   resource, no buffer, no host memory) from the call until it is freed through this
///   resource;
/// - never free, reuse or hand out again such memory before its
///   [`deallocate`](Self::deallocate) / [`deallocate_owned`](Self::deallocate_owned), and then
///   not before the work queued on that call's stream so far has finished with it;
/// - free nothing else: a free of an address it did not hand out (or of memory allocated owned,
///   through plain `deallocate`, where it keeps that mark) is an error, not a free;
/// - answer [`allocates_in_graphs`](Self::allocates_in_graphs) `true` when an allocation on a
///   capturing stream is a graph allocation node.
///
/// An adaptor that forwards each call to an upstream resource upholding this, and hands back
/// exactly what the upstream hands out, upholds it too (cuweave's adaptors do).
///
/// A resource written without `unsafe` does not compile, so safe code cannot lay a buffer over
/// memory that another owner uses:
///
/// ```compile_fail
/// use std::sync::Arc;
/// use cuweave_driver::memory::DevicePtr;
/// use cuweave_driver::{Context, Stream};
/// use cuweave_memory::MemoryResource;
///
/// struct HandsOutOneBlock(Arc<Context>, DevicePtr);
///
/// impl MemoryResource for HandsOutOneBlock {
///     fn allocate(&self, _: usize, _: &Stream) -> cuweave_memory::Result<DevicePtr> {
///         Ok(self.1) // the same block to every caller: two live buffers would share it
///     }
///     fn deallocate(&self, _: DevicePtr, _: usize, _: &Stream) -> cuweave_memory::Result<()> {
///         Ok(())
///     }
///     fn context(&self) -> &Arc<Context> {
///         &self.0
///     }
///     fn name(&self) -> &str {
///         "one block"
///     }
/// }
/// ```
#[allow(unsafe_code)] // the trait's contract, above; no unsafe block
pub unsafe trait MemoryResource: Send + Sync {
    /// Allocates `bytes` of device memory, usable by work queued on `stream` after this call.
    ///
    /// # Errors
    /// [`MemoryError::ZeroLength`] for zero bytes, [`MemoryError::WrongDevice`] for a stream of
    /// another device, and an out-of-memory error ([`MemoryError::is_out_of_memory`]) when the
    /// memory is not there.
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr>;

    /// Frees `ptr`, of `bytes` as allocated, after the work queued on `stream` so far.
    ///
    /// # Errors
    /// [`MemoryError::UnknownAllocation`] when `ptr` was not allocated here or was already freed,
    /// [`MemoryError::SizeMismatch`] when `bytes` is not its size; both leave it allocated.
    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()>;

    /// Allocates memory that a cuweave object will own for its whole life (a typed buffer, a
    /// caching allocator's segment), as [`allocate`](Self::allocate) does, but marked so that
    /// [`deallocate`](Self::deallocate) refuses it with [`MemoryError::OwnedAllocation`]: its
    /// address is visible to safe code ([`Buffer::device_ptr`](crate::Buffer::device_ptr)), and
    /// a free by address would hand memory its owner still uses to the next allocation. Only
    /// [`deallocate_owned`](Self::deallocate_owned) frees it.
    ///
    /// cuweave's resources and adaptors keep the mark (adaptors forward both calls to their
    /// upstream). The default, for a resource of a user's, is a plain `allocate`: such a
    /// resource keeps no mark, and `deallocate` there frees what its caller names.
    ///
    /// # Errors
    /// As [`allocate`](Self::allocate).
    fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.allocate(bytes, stream)
    }

    /// Frees memory from [`allocate_owned`](Self::allocate_owned), as
    /// [`deallocate`](Self::deallocate) does; called by its owner only. The default is a plain
    /// `deallocate`.
    ///
    /// # Errors
    /// As [`deallocate`](Self::deallocate); [`MemoryError::UnknownAllocation`] for memory that
    /// was not allocated owned.
    fn deallocate_owned(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        self.deallocate(ptr, bytes, stream)
    }

    /// Whether an allocation on a capturing stream is recorded into the graph as an allocation
    /// node (as `cuMemAllocFromPoolAsync`'s is) instead of handing out memory that exists now.
    /// Such memory exists only while a launch of the graph holds it, so a typed buffer made from
    /// it is usable by work captured into that capture alone
    /// ([`MemoryError::GraphAllocation`] otherwise). The default is `false`; a resource whose
    /// captured allocations are graph nodes must answer `true` (part of the trait's contract).
    fn allocates_in_graphs(&self) -> bool {
        false
    }

    /// The context whose device the memory is on.
    fn context(&self) -> &Arc<Context>;

    /// The device the memory is on.
    fn device(&self) -> Device {
        self.context().device()
    }

    /// A short name for statistics and logs, e.g. `statistics(limit(driver))`.
    fn name(&self) -> &str;

    /// Gives memory this resource keeps for reuse, with no allocation in it, back to the driver
    /// (RMM's pool `release`); a no-op for resources that keep nothing. Adaptors forward it to
    /// their upstream.
    ///
    /// Only memory whose frees have completed on their streams is free to give back:
    /// synchronise the streams frees were queued on first. The
    /// [`CachingAllocator`](crate::caching::CachingAllocator) calls this after handing segments
    /// back, so `empty_cache` over an [`AsyncPoolResource`] returns the memory to the device.
    ///
    /// # Errors
    /// The driver's error when the memory cannot be released.
    fn release_unused(&self) -> Result<()> {
        Ok(())
    }
}

/// `MemoryResource` for a smart pointer to one: every call forwards to the resource pointed
/// to, which upholds the contract.
macro_rules! forward_resource {
    ($($pointer:ident),+) => {$(
        // SAFETY: every call forwards to the resource behind the pointer, which upholds the
        // contract.
        #[allow(unsafe_code)]
        unsafe impl<R: MemoryResource + ?Sized> MemoryResource for $pointer<R> {
            fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
                (**self).allocate(bytes, stream)
            }

            fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
                (**self).deallocate(ptr, bytes, stream)
            }

            fn allocate_owned(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
                (**self).allocate_owned(bytes, stream)
            }

            fn deallocate_owned(
                &self,
                ptr: DevicePtr,
                bytes: usize,
                stream: &Stream,
            ) -> Result<()> {
                (**self).deallocate_owned(ptr, bytes, stream)
            }

            fn allocates_in_graphs(&self) -> bool {
                (**self).allocates_in_graphs()
            }

            fn context(&self) -> &Arc<Context> {
                (**self).context()
            }

            fn device(&self) -> Device {
                (**self).device()
            }

            fn name(&self) -> &str {
                (**self).name()
            }

            fn release_unused(&self) -> Result<()> {
                (**self).release_unused()
            }
        }
    )+};
}

forward_resource!(Arc, Box);

/// An error unless `stream` runs on `device`.
pub(crate) fn check_stream(device: Device, stream: &Stream, operation: &'static str) -> Result<()> {
    if stream.device() == device {
        Ok(())
    } else {
        Err(MemoryError::WrongDevice {
            operation,
            expected: device.ordinal(),
            actual: stream.device().ordinal(),
        })
    }
}

/// An error for a zero-byte request or a stream of another device.
pub(crate) fn check_request(
    device: Device,
    bytes: usize,
    stream: &Stream,
    operation: &'static str,
) -> Result<()> {
    if bytes == 0 {
        return Err(MemoryError::ZeroLength { operation });
    }
    check_stream(device, stream, operation)
}
