//! Running a chosen method on a (source, destination) pair: the real copies behind each
//! [`TransferMethod`].

use cuweave_memory::buffer::copy_peer;
use cuweave_memory::{Buffer, Element, MemLocation, PinnedBuffer, UnifiedBuffer};

use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::location::TransferPath;
use crate::manager::{TransferManager, pipeline};
use crate::method::TransferMethod;
use crate::staging::bounce;

use Destination as D;
use Source as S;
use TransferMethod::{HostStaged, PeerToPeer, UnifiedMemory, ZeroCopy};

/// Runs `method` (already checked against the path and devices by the planner) on a
/// non-empty, range-checked pair.
pub(crate) fn execute<T: Element>(
    manager: &TransferManager,
    method: TransferMethod,
    src: Source<'_, T>,
    dst: Destination<'_, T>,
) -> Result<()> {
    let n = src.len();
    match (src, dst) {
        // Host-visible pairs: a host memcpy (pinned buffers wait for their device uses first).
        (S::Host(s), D::Host(d)) => d.copy_from_slice(s),
        (S::Host(s), D::Pinned(b, o)) => b.copy_range_from_host(o, s)?,
        (S::Pinned(p, o, _), D::Host(d)) => p.copy_range_to_host(o, d)?,
        (S::Pinned(p, o, _), D::Pinned(b, o2)) => {
            b.copy_range_from_host(o2, &p.as_slice()?[o..o + n])?;
        }

        // Pageable host <-> device: the plain call or the pipeline.
        (S::Host(s), D::Device(b, o)) => pageable_up(manager, method, s, b, o)?,
        (S::Device(b, o, _), D::Host(d)) => pageable_down(manager, method, b, o, d)?,

        // Pinned host <-> device: a DMA from the host address, or through the mapped address.
        (S::Pinned(p, o, _), D::Device(b, o2)) => pinned_up(method, p, o, b, o2, n)?,
        (S::Device(s, o, _), D::Pinned(p, o2)) => pinned_down(method, s, o, p, o2, n)?,

        // Device <-> device, one device or two.
        (S::Device(s, o, _), D::Device(d, o2)) => between(manager, method, d, o2, s, o, n)?,

        // Unified memory: prefetch to where the copy runs, or let the driver fault pages in.
        (S::Host(s), D::Unified(u, o)) => match method {
            UnifiedMemory => {
                prefetch(manager, u, o, n, MemLocation::Host)?;
                u.as_mut_slice()?[o..o + n].copy_from_slice(s);
                let device = u.device().ordinal();
                prefetch(manager, u, o, n, MemLocation::Device(device))?;
            }
            _ => u.copy_range_from_host(o, s)?,
        },
        (S::Unified(u, o, _), D::Host(d)) => match method {
            UnifiedMemory => {
                prefetch(manager, u, o, n, MemLocation::Host)?;
                d.copy_from_slice(&u.as_slice()?[o..o + n]);
            }
            _ => u.copy_range_to_host(o, d)?,
        },
        (S::Unified(u, o, _), D::Device(d, o2)) => {
            if u.device() != d.device() {
                copy_peer(d, o2, u, o, n, manager.lane(d.device().ordinal())?.stream())?;
            } else {
                if method == UnifiedMemory {
                    prefetch(manager, u, o, n, MemLocation::Device(u.device().ordinal()))?;
                }
                d.copy_range_from(o2, u, o, n)?;
            }
        }
        (S::Device(s, o, _), D::Unified(u, o2)) => {
            if u.device() != s.device() {
                copy_peer(u, o2, s, o, n, manager.lane(u.device().ordinal())?.stream())?;
            } else {
                if method == UnifiedMemory {
                    prefetch(manager, u, o2, n, MemLocation::Device(u.device().ordinal()))?;
                }
                u.copy_range_from(o2, s, o, n)?;
            }
        }
        (S::Unified(a, o, _), D::Unified(b, o2)) => {
            if a.device() == b.device() {
                b.copy_range_from(o2, a, o, n)?;
            } else {
                copy_peer(b, o2, a, o, n, manager.lane(b.device().ordinal())?.stream())?;
            }
        }
        (S::Pinned(p, o, _), D::Unified(u, o2)) => {
            u.copy_range_from_host(o2, &p.as_slice()?[o..o + n])?;
        }
        (S::Unified(u, o, _), D::Pinned(p, o2)) => {
            u.copy_range_to_host(o, &mut p.as_mut_slice()?[o2..o2 + n])?;
        }

        // Views of buffers: moved as their buffer's device memory, by the copies every kind of
        // buffer takes (a pinned side DMAs from or to its host address, as `DirectCopy` does).
        (S::Host(s), D::View(mut v)) => pageable_up(manager, method, s, &mut v, 0)?,
        (S::View(v), D::Host(d)) => pageable_down(manager, method, &v, 0, d)?,
        (S::Pinned(p, o, _), D::View(mut v)) => pinned_up(method, p, o, &mut v, 0, n)?,
        (S::View(v), D::Pinned(p, o2)) => pinned_down(method, &v, 0, p, o2, n)?,
        (S::View(v), D::View(mut w)) => between(manager, method, &mut w, 0, &v, 0, n)?,
        (S::View(v), D::Device(d, o2)) => between(manager, method, d, o2, &v, 0, n)?,
        (S::View(v), D::Unified(u, o2)) => between(manager, method, u, o2, &v, 0, n)?,
        (S::Device(b, o, _), D::View(mut w)) => between(manager, method, &mut w, 0, b, o, n)?,
        (S::Unified(u, o, _), D::View(mut w)) => between(manager, method, &mut w, 0, u, o, n)?,

        // Registered host memory: page-locked, so the driver DMAs it directly to and from any
        // device (the registration is portable); with other host-visible memory a `memcpy`
        // (pinned and unified buffers wait for their device uses first).
        (S::Registered(r, o, _), dst) => {
            let s = &r.as_slice()[o..o + n];
            match dst {
                D::Host(d) => d.copy_from_slice(s),
                D::Registered(mut d, o2) => d.as_mut_slice()[o2..o2 + n].copy_from_slice(s),
                D::Pinned(b, o2) => b.copy_range_from_host(o2, s)?,
                D::Device(b, o2) => b.copy_range_from_host(o2, s)?,
                D::Unified(u, o2) => u.copy_range_from_host(o2, s)?,
                D::View(mut v) => v.copy_range_from_host(0, s)?,
            }
        }
        (src, D::Registered(mut r, o2)) => {
            let d = &mut r.as_mut_slice()[o2..o2 + n];
            match src {
                S::Host(s) => d.copy_from_slice(s),
                S::Pinned(p, o, _) => p.copy_range_to_host(o, d)?,
                S::Device(b, o, _) => b.copy_range_to_host(o, d)?,
                S::Unified(u, o, _) => u.copy_range_to_host(o, d)?,
                S::View(v) => v.copy_range_to_host(0, d)?,
                // Matched by the arm above.
                S::Registered(s, o, _) => d.copy_from_slice(&s.as_slice()[o..o + n]),
            }
        }
    }
    Ok(())
}

/// Pageable host memory into device memory (a buffer or a view): the pipeline, or the plain call.
fn pageable_up<T, B>(
    manager: &TransferManager,
    method: TransferMethod,
    src: &[T],
    dst: &mut B,
    offset: usize,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + Send + ?Sized,
{
    if method == HostStaged {
        let device = dst.device().ordinal();
        let mut lane = manager.lane(device)?;
        let bytes = size_of_val(src);
        let config = manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, device, bytes);
        pipeline(&mut lane, config, bytes).upload(src, dst, offset)?;
    } else {
        dst.copy_range_from_host(offset, src)?;
    }
    Ok(())
}

/// Device memory (a buffer or a view) into pageable host memory: the pipeline, or the plain call.
fn pageable_down<T, B>(
    manager: &TransferManager,
    method: TransferMethod,
    src: &B,
    offset: usize,
    dst: &mut [T],
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + Sync + ?Sized,
{
    if method == HostStaged {
        let device = src.device().ordinal();
        let mut lane = manager.lane(device)?;
        let bytes = size_of_val(dst);
        let config = manager.staging_for(TransferPath::DEVICE_TO_PAGEABLE, device, bytes);
        pipeline(&mut lane, config, bytes).download(src, offset, dst)?;
    } else {
        src.copy_range_to_host(offset, dst)?;
    }
    Ok(())
}

/// `n` elements of a pinned buffer into device memory: through the mapped address
/// (`ZeroCopy`), or a DMA from the host address.
fn pinned_up<T, B>(
    method: TransferMethod,
    src: &PinnedBuffer<T>,
    src_offset: usize,
    dst: &mut B,
    dst_offset: usize,
    n: usize,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    match method {
        ZeroCopy => dst.copy_range_from(dst_offset, src, src_offset, n)?,
        _ => dst.copy_range_from_host(dst_offset, &src.as_slice()?[src_offset..src_offset + n])?,
    }
    Ok(())
}

/// `n` elements of device memory into a pinned buffer: through the mapped address
/// (`ZeroCopy`), or a DMA to the host address.
fn pinned_down<T, B>(
    method: TransferMethod,
    src: &B,
    src_offset: usize,
    dst: &mut PinnedBuffer<T>,
    dst_offset: usize,
    n: usize,
) -> Result<()>
where
    T: Element,
    B: Buffer<T> + ?Sized,
{
    match method {
        ZeroCopy => dst.copy_range_from(dst_offset, src, src_offset, n)?,
        _ => src.copy_range_to_host(
            src_offset,
            &mut dst.as_mut_slice()?[dst_offset..dst_offset + n],
        )?,
    }
    Ok(())
}

/// Copies `n` elements between two device buffers or views of them, on one device or two: a
/// device copy on one; on two, by `method` (peer access, the pinned bounce, or the driver's own
/// peer copy).
fn between<T, D, S>(
    manager: &TransferManager,
    method: TransferMethod,
    dst: &mut D,
    dst_offset: usize,
    src: &S,
    src_offset: usize,
    n: usize,
) -> Result<()>
where
    T: Element,
    D: Buffer<T> + ?Sized,
    S: Buffer<T> + ?Sized,
{
    let (from, to) = (src.device().ordinal(), dst.device().ordinal());
    if from == to {
        dst.copy_range_from(dst_offset, src, src_offset, n)?;
        return Ok(());
    }
    match method {
        PeerToPeer => {
            manager.enable_peers(from, to)?;
            copy_peer(
                dst,
                dst_offset,
                src,
                src_offset,
                n,
                manager.lane(to)?.stream(),
            )?;
        }
        HostStaged => {
            let (src_lane, dst_lane) = (manager.lane(from)?, manager.lane(to)?);
            let config = manager.staging_for(TransferPath::PEER, from, n * size_of::<T>());
            bounce(
                &src_lane.state.pool,
                config,
                src,
                src_offset,
                src_lane.stream(),
                dst,
                dst_offset,
                dst_lane.stream(),
                n,
            )?;
        }
        _ => copy_peer(
            dst,
            dst_offset,
            src,
            src_offset,
            n,
            manager.lane(to)?.stream(),
        )?,
    }
    Ok(())
}

/// Migrates elements `offset..offset + len` of `buffer` to `location` and waits for it.
fn prefetch<T: Element>(
    manager: &TransferManager,
    buffer: &UnifiedBuffer<T>,
    offset: usize,
    len: usize,
    location: MemLocation,
) -> Result<()> {
    let lane = manager.lane(buffer.device().ordinal())?;
    let stream = lane.stream();
    buffer.prefetch_range(offset, len, location, stream)?;
    stream.synchronize().map_err(TransferError::from)
}
