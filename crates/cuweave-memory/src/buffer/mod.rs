//! Typed buffers: [`DeviceBuffer`], [`PinnedBuffer`] and [`UnifiedBuffer`], and the
//! [`Buffer`] trait they share.
//!
//! # The model
//!
//! Elements are plain data ([`Element`](crate::Element)): any bytes the GPU writes are a valid
//! value. Every buffer remembers its uses on streams, reads apart from writes ([`Access`]), as
//! events recorded after them: the last write, and one event per stream that read it since. Each
//! operation on a buffer, on any stream, first makes its stream wait (device-side,
//! `cuStreamWaitEvent`) for the uses it conflicts with (a read for the last write; a write for
//! the last write and every read since), then queues its work, then records its access. So:
//!
//! - two uses of one buffer never race on the GPU, whatever streams they are on, and reads on
//!   different streams run at the same time;
//! - host access to pinned and unified buffers waits for (or refuses while) queued device work,
//!   and its guard ([`HostSlice`], [`HostSliceMut`]) holds back the launches of graphs whose
//!   captures conflict with it;
//! - a buffer's memory is never reused or freed under queued work: a [`DeviceBuffer`] hands its
//!   use events to its allocator on drop (which reuses the block only once they have passed, and
//!   never blocks), pinned and unified buffers wait for them.
//!
//! Kernels you launch yourself on [`Buffer::device_ptr`] join the same order through
//! [`Buffer::prepare_read`] / [`Buffer::record_read`] or [`Buffer::prepare_write`] /
//! [`Buffer::record_write`] (`prepare_use` / `record_use` mean a write), or all at once through
//! [`TrackedLaunch`](crate::TrackedLaunch).
//!
//! # Asynchronous copies own their host side
//!
//! An async copy between a buffer and host memory takes the host side by value (a `Vec<T>`, a
//! `Box<[T]>`, a [`PinnedBuffer`], or a borrow of one: see [`HostSource`] and [`HostSink`])
//! and returns a [`PendingCopy`] that gives it back from [`PendingCopy::wait`] once the stream
//! has passed the copy. Dropping the `PendingCopy` waits too; `mem::forget` leaks the host
//! memory rather than freeing it under the copy engine. Safe code cannot read, change or free
//! host memory that a queued copy still uses.
//!
//! # Errors
//!
//! Zero lengths, ranges past the end, mismatched lengths, overflowing sizes and streams of
//! another device are typed [`MemoryError`](crate::MemoryError)s, checked before any driver
//! call.
//!
//! ```no_run
//! use cuweave_driver::{Context, Device, Stream, StreamFlags};
//! use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer};
//!
//! # fn main() -> cuweave_memory::Result<()> {
//! let context = Context::primary(Device::get(0)?)?;
//! let (a, b) = (
//!     Stream::new(&context, StreamFlags::NON_BLOCKING)?,
//!     Stream::new(&context, StreamFlags::NON_BLOCKING)?,
//! );
//! let mut device = DeviceBuffer::<u64>::new_on(&a, 1024)?;
//! let upload = device.copy_from_host_async(PinnedBuffer::from_slice(&context, &[5u64; 1024])?, &a)?;
//! // Stream `b` waits for the upload on `a` before reading.
//! let download = device.copy_to_host_async(vec![0u64; 1024], &b)?;
//! assert_eq!(download.wait()?, vec![5u64; 1024]);
//! upload.wait()?;
//! # Ok(())
//! # }
//! ```

pub(crate) mod capture;
mod common;
mod device;
mod fill;
mod graph_held;
pub(crate) mod host;
mod host_slice;
mod pending;
// Unsafe is allowed here too: the peer copy calls the driver's raw `cuMemcpyPeerAsync`.
#[allow(unsafe_code)]
mod peer;
mod pinned;
pub(crate) mod range;
// Unsafe is allowed here alone in this module: the driver's raw copies and memsets take raw
// pointers, and managed memory becomes a host slice only through a raw pointer.
#[allow(unsafe_code)]
pub(crate) mod raw;
mod staged;
mod staging;
pub(crate) mod tracker;
mod unified;
mod uses;
mod view;

pub use common::Buffer;
pub use device::DeviceBuffer;
pub(crate) use device::deallocate_eagerly_used;
pub use host::{HostRefusal, HostSink, HostSource, host_refusal, split_host_refusal};
pub use host_slice::{HostSlice, HostSliceMut};
pub use peer::{copy_peer, copy_peer_async};
pub use pending::{MarkedCopy, PendingCopy};
pub use pinned::PinnedBuffer;
pub use staged::{FromDevice, Staged, StagedRead, StagedWrite, ToDevice};
pub use tracker::Access;
pub use unified::UnifiedBuffer;
pub use view::{BufferSlice, BufferSliceMut};

pub(crate) use common::sealed::Sealed;

#[cfg(test)]
mod tests {
    use super::*;

    fn send_sync<T: Send + Sync>() {}

    #[test]
    fn buffers_and_pending_copies_cross_threads() {
        send_sync::<DeviceBuffer<f32>>();
        send_sync::<PinnedBuffer<u8>>();
        send_sync::<UnifiedBuffer<u64>>();
        send_sync::<PendingCopy<Vec<u32>>>();
        send_sync::<PendingCopy<PinnedBuffer<u32>>>();
        send_sync::<PendingCopy<&mut PinnedBuffer<u32>>>();
    }
}
