//! Typed operations on a [`PriorityStream`]: async copies and fills of `cuweave-memory` buffers
//! and unified-memory prefetch, each checked for the device and counted.

use cuweave_memory::{
    Buffer, Element, HostRefusal, HostSink, HostSource, MemLocation, MemoryError, PendingCopy,
    UnifiedBuffer, host_refusal, split_host_refusal,
};

use super::{OperationKind, PriorityStream};
use crate::error::{Result, StreamError, ensure_device};

impl PriorityStream {
    fn ensure_buffer_device(
        &self,
        operation: &'static str,
        device: cuweave_driver::Device,
    ) -> Result<()> {
        ensure_device(operation, self.device().ordinal(), device.ordinal())
    }

    /// Queues a copy of `host` (exactly `dst.len()` elements) into `dst`; the [`PendingCopy`]
    /// owns `host` until the GPU is past the copy.
    ///
    /// # Errors
    /// The host side's [`HostRefusal`] over [`StreamError`]: a
    /// [`HostCopyError`](cuweave_memory::HostCopyError) that hands an owned `host` back whenever
    /// no copy of it can still run, the [`StreamError`] alone for a borrowed pinned buffer.
    /// [`StreamError::WrongDevice`] for a buffer of another device; the memory layer's errors
    /// (mismatched lengths, a pageable host side on a capturing stream, the driver's). `?`
    /// turns it into a [`StreamError`].
    pub fn copy_from_host<T: Element, B: Buffer<T>, H: HostSource<T>>(
        &self,
        dst: &mut B,
        host: H,
    ) -> std::result::Result<PendingCopy<H>, HostRefusal<H, T, StreamError>> {
        const OP: &str = "PriorityStream::copy_from_host";
        let bytes = dst.byte_size() as u64;
        let device = dst.device();
        self.copy_with_host(
            OP,
            (device, bytes),
            host,
            |host, stream| dst.copy_from_host_async(host, stream),
            split_host_refusal::<T, H, MemoryError>,
            host_refusal::<T, H, StreamError>,
        )
    }

    /// Queues a copy of `src` into `host` (exactly `src.len()` elements);
    /// [`PendingCopy::wait`] gives `host` back holding the data.
    ///
    /// # Errors
    /// As [`copy_from_host`](Self::copy_from_host).
    pub fn copy_to_host<T: Element, B: Buffer<T>, H: HostSink<T>>(
        &self,
        src: &B,
        host: H,
    ) -> std::result::Result<PendingCopy<H>, HostRefusal<H, T, StreamError>> {
        const OP: &str = "PriorityStream::copy_to_host";
        let bytes = src.byte_size() as u64;
        self.copy_with_host(
            OP,
            (src.device(), bytes),
            host,
            |host, stream| src.copy_to_host_async(host, stream),
            split_host_refusal::<T, H, MemoryError>,
            host_refusal::<T, H, StreamError>,
        )
    }

    /// Queues `copy` of `host` through [`enqueue`](Self::enqueue) for a buffer of `device`
    /// moving `bytes`, and hands `host` back with any error that leaves it unused: refused
    /// before `copy` ran, or handed back by the memory layer (`split` takes its refusal apart,
    /// `refuse` makes this layer's).
    fn copy_with_host<H, M, R>(
        &self,
        operation: &'static str,
        (device, bytes): (cuweave_driver::Device, u64),
        host: H,
        copy: impl FnOnce(H, &cuweave_driver::Stream) -> std::result::Result<PendingCopy<H>, M>,
        split: impl FnOnce(M) -> (MemoryError, Option<H>),
        refuse: impl Fn(StreamError, Option<H>) -> R,
    ) -> std::result::Result<PendingCopy<H>, R> {
        if let Err(error) = self.ensure_buffer_device(operation, device) {
            return Err(refuse(error, Some(host)));
        }
        let mut unused = Some(host);
        let mut handed_back = None;
        let queued = self.enqueue(OperationKind::Copy, bytes, |stream| {
            let host = unused.take().expect("the copy runs once");
            copy(host, stream).map_err(|refused| {
                let (error, host) = split(refused);
                handed_back = host;
                error
            })
        });
        queued.map_err(|error| refuse(error, handed_back.or(unused)))
    }

    /// Queues a device-to-device copy of `src` into `dst` (same length, same device).
    ///
    /// # Errors
    /// As [`copy_from_host`](Self::copy_from_host).
    pub fn copy_buffer<T: Element, D: Buffer<T>, S: Buffer<T> + ?Sized>(
        &self,
        dst: &mut D,
        src: &S,
    ) -> Result<()> {
        self.ensure_buffer_device("PriorityStream::copy_buffer", dst.device())?;
        self.ensure_buffer_device("PriorityStream::copy_buffer", src.device())?;
        let bytes = dst.byte_size() as u64;
        self.enqueue(OperationKind::Copy, bytes, |stream| {
            dst.copy_from_async(src, stream)
        })
    }

    /// Queues setting every element of `dst` to `value` (a memset where the value's bytes allow).
    ///
    /// # Errors
    /// [`StreamError::WrongDevice`] for a buffer of another device.
    pub fn fill<T: Element, B: Buffer<T>>(&self, dst: &mut B, value: T) -> Result<()> {
        self.ensure_buffer_device("PriorityStream::fill", dst.device())?;
        let bytes = dst.byte_size() as u64;
        self.enqueue(OperationKind::Memset, bytes, |stream| {
            dst.fill_async(value, stream)
        })
    }

    /// Queues a migration of a unified buffer to `location` (a device or the host).
    ///
    /// # Errors
    /// [`StreamError::WrongDevice`] for a buffer of another
    /// device; the memory layer's capability errors on devices without managed memory.
    pub fn prefetch<T: Element>(
        &self,
        buffer: &UnifiedBuffer<T>,
        location: MemLocation,
    ) -> Result<()> {
        self.ensure_buffer_device("PriorityStream::prefetch", buffer.device())?;
        let bytes = buffer.byte_size() as u64;
        self.enqueue(OperationKind::Prefetch, bytes, |stream| {
            buffer.prefetch_to(location, stream)
        })
    }
}
