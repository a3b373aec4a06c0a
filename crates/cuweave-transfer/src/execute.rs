//! Running a chosen method on a (source, destination) pair: the real copies behind each
//! [`TransferMethod`].

use cuweave_memory::buffer::copy_peer;
use cuweave_memory::{Buffer, Element, MemLocation, UnifiedBuffer};

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
        (S::Host(s), D::Device(b, o)) => match method {
            HostStaged => {
                let device = b.device().ordinal();
                let lane = manager.lane(device)?;
                let config =
                    manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, device, size_of_val(s));
                pipeline(&lane, config).upload(s, b, o)?;
            }
            _ => b.copy_range_from_host(o, s)?,
        },
        (S::Device(b, o, _), D::Host(d)) => match method {
            HostStaged => {
                let device = b.device().ordinal();
                let lane = manager.lane(device)?;
                let config =
                    manager.staging_for(TransferPath::DEVICE_TO_PAGEABLE, device, size_of_val(d));
                pipeline(&lane, config).download(b, o, d)?;
            }
            _ => b.copy_range_to_host(o, d)?,
        },

        // Pinned host <-> device: a DMA from the host address, or through the mapped address.
        (S::Pinned(p, o, _), D::Device(b, o2)) => match method {
            ZeroCopy => b.copy_range_from(o2, p, o, n)?,
            _ => b.copy_range_from_host(o2, &p.as_slice()?[o..o + n])?,
        },
        (S::Device(s, o, _), D::Pinned(p, o2)) => match method {
            ZeroCopy => p.copy_range_from(o2, s, o, n)?,
            _ => s.copy_range_to_host(o, &mut p.as_mut_slice()?[o2..o2 + n])?,
        },

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
        (S::Host(s), D::View(mut v)) => match method {
            HostStaged => {
                let device = v.device().ordinal();
                let lane = manager.lane(device)?;
                let config =
                    manager.staging_for(TransferPath::PAGEABLE_TO_DEVICE, device, size_of_val(s));
                pipeline(&lane, config).upload(s, &mut v, 0)?;
            }
            _ => v.copy_range_from_host(0, s)?,
        },
        (S::View(v), D::Host(d)) => match method {
            HostStaged => {
                let device = v.device().ordinal();
                let lane = manager.lane(device)?;
                let config =
                    manager.staging_for(TransferPath::DEVICE_TO_PAGEABLE, device, size_of_val(d));
                pipeline(&lane, config).download(&v, 0, d)?;
            }
            _ => v.copy_range_to_host(0, d)?,
        },
        (S::Pinned(p, o, _), D::View(mut v)) => match method {
            ZeroCopy => v.copy_range_from(0, p, o, n)?,
            _ => v.copy_range_from_host(0, &p.as_slice()?[o..o + n])?,
        },
        (S::View(v), D::Pinned(p, o2)) => match method {
            ZeroCopy => p.copy_range_from(o2, &v, 0, n)?,
            _ => v.copy_range_to_host(0, &mut p.as_mut_slice()?[o2..o2 + n])?,
        },
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
