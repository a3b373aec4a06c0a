//! [`TransferBackend`]: the seam for other kinds of device.
//!
//! The [`TransferManager`] is CUDA's; a backend is the small surface a different device API
//! offers for moving bytes: allocate device memory, upload from host bytes, download to host
//! bytes, copy between two allocations. Two real backends live here: [`CudaBackend`] (through
//! a `TransferManager`, so its uploads and downloads take the planned, pipelined paths) and
//! [`HostBackend`] (plain host memory, where every transfer is a `memcpy`), which is what a
//! CPU-only run of a program written against the trait uses.
//!
//! # What a Metal or WebGPU backend would implement
//! - **Metal** (`metal` crate): `Memory = metal::Buffer` (`MTLBuffer`, `StorageModePrivate` for
//!   device memory); `upload` writes a `StorageModeShared` staging buffer (unified memory on
//!   Apple silicon makes that the zero-copy path) and encodes a `MTLBlitCommandEncoder`
//!   `copy_from_buffer` into the private one; `download` the reverse plus
//!   `wait_until_completed`; `copy` one blit between the two buffers.
//! - **WebGPU** (`wgpu`): `Memory = wgpu::Buffer` with `COPY_SRC | COPY_DST` usage; `upload` is
//!   `Queue::write_buffer`; `download` copies into a `MAP_READ` buffer with
//!   `CommandEncoder::copy_buffer_to_buffer`, then `map_async` and `Device::poll(Maintain::Wait)`;
//!   `copy` is `copy_buffer_to_buffer`. WebGPU requires offsets and lengths that are multiples
//!   of 4 (`COPY_BUFFER_ALIGNMENT`), which its backend would check and report as `OutOfRange`.
//!
//! Neither is written here: nothing on this machine could run it.

use cuweave_memory::{DeviceBuffer, MemoryError};

use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::manager::TransferManager;

/// Which device API a backend drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// NVIDIA CUDA, through the driver API.
    Cuda,
    /// Host memory only (no device).
    Host,
}

/// Moving bytes on one kind of device: allocation, upload, download and copy.
///
/// Offsets and lengths are in bytes; every call is blocking (the data is in place when it
/// returns); ranges outside an allocation are [`TransferError::OutOfRange`].
pub trait TransferBackend: Send + Sync {
    /// An allocation of device memory.
    type Memory: Send;

    /// Which API this is.
    fn kind(&self) -> BackendKind;

    /// How many devices it drives.
    fn device_count(&self) -> usize;

    /// `bytes` of zeroed memory on `device`.
    ///
    /// # Errors
    /// `NoSuchDevice` for a device it does not drive, the memory layer's `ZeroLength` for no
    /// bytes, the backend's error when allocation fails.
    fn allocate(&self, device: usize, bytes: usize) -> Result<Self::Memory>;

    /// Copies host bytes into `dst` from `offset`.
    ///
    /// # Errors
    /// `OutOfRange` for a bad range, the backend's error otherwise.
    fn upload(&self, src: &[u8], dst: &mut Self::Memory, offset: usize) -> Result<()>;

    /// Copies `dst.len()` bytes of `src` from `offset` into host memory.
    ///
    /// # Errors
    /// `OutOfRange` for a bad range, the backend's error otherwise.
    fn download(&self, src: &Self::Memory, offset: usize, dst: &mut [u8]) -> Result<()>;

    /// Copies `len` bytes between allocations (possibly of two devices).
    ///
    /// # Errors
    /// `OutOfRange` for a bad range, the backend's error otherwise.
    fn copy(
        &self,
        src: &Self::Memory,
        src_offset: usize,
        dst: &mut Self::Memory,
        dst_offset: usize,
        len: usize,
    ) -> Result<()>;
}

/// CUDA through a [`TransferManager`]: device memory is a `DeviceBuffer<u8>`.
#[derive(Debug)]
pub struct CudaBackend {
    manager: TransferManager,
}

impl CudaBackend {
    /// A backend over `manager`.
    pub fn new(manager: TransferManager) -> Self {
        Self { manager }
    }

    /// The manager it moves bytes with.
    pub fn manager(&self) -> &TransferManager {
        &self.manager
    }
}

impl TransferBackend for CudaBackend {
    type Memory = DeviceBuffer<u8>;

    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn device_count(&self) -> usize {
        self.manager.device_count()
    }

    fn allocate(&self, device: usize, bytes: usize) -> Result<Self::Memory> {
        let state = self.manager.device(device)?;
        Ok(DeviceBuffer::zeroed(&state.context, bytes)?)
    }

    fn upload(&self, src: &[u8], dst: &mut Self::Memory, offset: usize) -> Result<()> {
        self.manager
            .transfer(src, Destination::Device(dst, offset))
            .map(drop)
    }

    fn download(&self, src: &Self::Memory, offset: usize, dst: &mut [u8]) -> Result<()> {
        let len = dst.len();
        self.manager
            .transfer(Source::device(src, offset, len), Destination::Host(dst))
            .map(drop)
    }

    fn copy(
        &self,
        src: &Self::Memory,
        src_offset: usize,
        dst: &mut Self::Memory,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.manager
            .transfer(
                Source::device(src, src_offset, len),
                Destination::Device(dst, dst_offset),
            )
            .map(drop)
    }
}

/// Host memory as the "device": every transfer is a `memcpy`. For programs written against
/// [`TransferBackend`] running where no GPU is.
#[derive(Debug, Clone, Copy, Default)]
pub struct HostBackend;

fn host_range(
    side: &'static str,
    offset: usize,
    len: usize,
    capacity: usize,
) -> Result<std::ops::Range<usize>> {
    match offset.checked_add(len) {
        Some(end) if end <= capacity => Ok(offset..end),
        _ => Err(TransferError::OutOfRange {
            side,
            offset,
            len,
            capacity,
        }),
    }
}

impl TransferBackend for HostBackend {
    type Memory = Vec<u8>;

    fn kind(&self) -> BackendKind {
        BackendKind::Host
    }

    fn device_count(&self) -> usize {
        1
    }

    fn allocate(&self, device: usize, bytes: usize) -> Result<Self::Memory> {
        if device >= self.device_count() {
            return Err(TransferError::NoSuchDevice {
                device,
                count: self.device_count(),
            });
        }
        if bytes == 0 {
            return Err(MemoryError::ZeroLength {
                operation: "allocate",
            }
            .into());
        }
        Ok(vec![0; bytes])
    }

    fn upload(&self, src: &[u8], dst: &mut Self::Memory, offset: usize) -> Result<()> {
        let range = host_range("destination", offset, src.len(), dst.len())?;
        dst[range].copy_from_slice(src);
        Ok(())
    }

    fn download(&self, src: &Self::Memory, offset: usize, dst: &mut [u8]) -> Result<()> {
        let range = host_range("source", offset, dst.len(), src.len())?;
        dst.copy_from_slice(&src[range]);
        Ok(())
    }

    fn copy(
        &self,
        src: &Self::Memory,
        src_offset: usize,
        dst: &mut Self::Memory,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        let from = host_range("source", src_offset, len, src.len())?;
        let to = host_range("destination", dst_offset, len, dst.len())?;
        dst[to].copy_from_slice(&src[from]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip<B: TransferBackend>(backend: &B) -> Result<Vec<u8>> {
        let mut a = backend.allocate(0, 64)?;
        let mut b = backend.allocate(0, 64)?;
        backend.upload(&[1, 2, 3, 4], &mut a, 10)?;
        backend.copy(&a, 10, &mut b, 60, 4)?;
        let mut out = vec![0; 4];
        backend.download(&b, 60, &mut out)?;
        Ok(out)
    }

    #[test]
    fn the_host_backend_moves_bytes_and_checks_ranges() {
        assert_eq!(round_trip(&HostBackend).unwrap(), vec![1, 2, 3, 4]);
        let mut m = HostBackend.allocate(0, 8).unwrap();
        assert!(matches!(
            HostBackend.upload(&[0; 4], &mut m, 5),
            Err(TransferError::OutOfRange {
                side: "destination",
                offset: 5,
                len: 4,
                capacity: 8
            })
        ));
        let mut out = [0u8; 2];
        assert!(HostBackend.download(&m, usize::MAX, &mut out).is_err());
        assert_eq!(HostBackend.kind(), BackendKind::Host);
    }

    #[test]
    fn the_host_backend_refuses_what_the_cuda_backend_refuses() {
        assert!(matches!(
            HostBackend.allocate(1, 16),
            Err(TransferError::NoSuchDevice {
                device: 1,
                count: 1
            })
        ));
        assert!(matches!(
            HostBackend.allocate(0, 0),
            Err(TransferError::Memory(MemoryError::ZeroLength { .. }))
        ));
        assert_eq!(HostBackend.allocate(0, 3).unwrap(), vec![0; 3]);
    }
}
