//! [`TransferMethod`]: the ways bytes can move, and which of them serve each path.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::location::{LocationKind, TransferPath};

/// A way of moving bytes. Every method is a real implementation; one a device cannot do is
/// skipped (by [`plan`](crate::TransferManager::plan)) for the next one that it can.
///
/// | method | what runs |
/// |---|---|
/// | `DirectCopy` | the plain driver copy for the pair: `cuMemcpyHtoD` / `cuMemcpyDtoH` (pageable or pinned host), `cuMemcpyDtoD` (one device, unified addressing), `cuMemcpyPeerAsync` without enabling peer access (the driver stages it), or a host `memcpy` between host-visible memory |
/// | `HostStaged` | the pipeline: host threads copy chunks of pageable memory into pinned blocks of the `PinnedPool` while the copy engine moves earlier chunks (both directions); between devices, chunks bounce through pinned blocks, download and upload overlapped |
/// | `UnifiedMemory` | managed memory is prefetched (`cuMemPrefetchAsync`) to the side that does the copy, then copied there: to the device for device copies, to the host for host copies |
/// | `PeerToPeer` | peer access enabled once per device pair (cached), then `cuMemcpyPeerAsync` over NVLink / PCIe |
/// | `ZeroCopy` | no staging copy at all: the copy engine reads (or writes) the pinned host memory through its mapped device address (`cuMemcpyDtoD` on the address from `cuMemHostGetDevicePointer`) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransferMethod {
    /// The plain driver copy (or host `memcpy`) for the pair.
    DirectCopy,
    /// Pipelined through pinned staging blocks.
    HostStaged,
    /// Prefetch managed memory, then copy.
    UnifiedMemory,
    /// Direct copy between two devices with peer access enabled.
    PeerToPeer,
    /// The copy engine addresses mapped pinned host memory directly.
    ZeroCopy,
}

impl TransferMethod {
    /// Every method.
    pub const ALL: [Self; 5] = [
        Self::DirectCopy,
        Self::HostStaged,
        Self::UnifiedMemory,
        Self::PeerToPeer,
        Self::ZeroCopy,
    ];

    /// The name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            Self::DirectCopy => "direct",
            Self::HostStaged => "staged",
            Self::UnifiedMemory => "unified",
            Self::PeerToPeer => "p2p",
            Self::ZeroCopy => "zero_copy",
        }
    }

    /// The methods that can serve `path`, in order of preference when nothing was measured.
    pub fn candidates(path: TransferPath) -> &'static [Self] {
        use LocationKind::{Device, Pageable, Pinned, Unified};
        match (path.src, path.dst, path.cross_device) {
            (Pageable, Device, _) | (Device, Pageable, _) => &[Self::HostStaged, Self::DirectCopy],
            (Pinned, Device, false) | (Device, Pinned, false) => {
                &[Self::DirectCopy, Self::ZeroCopy]
            }
            (Device, Device, true) => &[Self::PeerToPeer, Self::HostStaged, Self::DirectCopy],
            (Pageable, Unified, _) | (Unified, Pageable, _) => {
                &[Self::UnifiedMemory, Self::DirectCopy]
            }
            (Unified, Device, false) | (Device, Unified, false) => {
                &[Self::UnifiedMemory, Self::DirectCopy]
            }
            _ => &[Self::DirectCopy],
        }
    }
}

impl fmt::Display for TransferMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::DirectCopy => "DirectCopy",
            Self::HostStaged => "HostStaged",
            Self::UnifiedMemory => "UnifiedMemory",
            Self::PeerToPeer => "PeerToPeer",
            Self::ZeroCopy => "ZeroCopy",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_has_direct_copy_as_a_last_resort() {
        use LocationKind::*;
        for src in [Pageable, Pinned, Device, Unified] {
            for dst in [Pageable, Pinned, Device, Unified] {
                for cross_device in [false, true] {
                    let path = TransferPath {
                        src,
                        dst,
                        cross_device,
                    };
                    let candidates = TransferMethod::candidates(path);
                    assert!(candidates.contains(&TransferMethod::DirectCopy), "{path}");
                }
            }
        }
    }

    #[test]
    fn pageable_paths_prefer_the_pipeline_and_peers_prefer_p2p() {
        assert_eq!(
            TransferMethod::candidates(TransferPath::PAGEABLE_TO_DEVICE)[0],
            TransferMethod::HostStaged
        );
        assert_eq!(
            TransferMethod::candidates(TransferPath::PEER)[0],
            TransferMethod::PeerToPeer
        );
        assert_eq!(
            TransferMethod::candidates(TransferPath::DEVICE_TO_DEVICE),
            &[TransferMethod::DirectCopy]
        );
    }
}
