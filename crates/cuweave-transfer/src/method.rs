//! [`TransferMethod`]: the ways bytes can move, and which of them serve each path.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::location::{LocationKind, TransferPath};

/// A way of moving bytes. Every method is a real implementation; one a device cannot do is
/// skipped (by [`plan`](crate::TransferManager::plan)) for the next one that it can.
///
/// | method | what runs |
/// |---|---|
/// | `DirectCopy` | the plain driver copy for the pair: `cuMemcpyHtoD` / `cuMemcpyDtoH` (pageable, pinned or registered host), `cuMemcpyDtoD` (one device, unified addressing), `cuMemcpyPeerAsync` without enabling peer access (the driver stages it), or a host `memcpy` between host-visible memory |
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
        use LocationKind::{Device, Pageable, Pinned, Registered, Unified};
        match (path.src, path.dst, path.cross_device) {
            // Already page-locked: the driver DMAs it directly; see `not_served_because`.
            (Registered, _, _) | (_, Registered, _) => &[Self::DirectCopy],
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

    /// Why `self` is not among `path`'s [`candidates`](Self::candidates), where that is not
    /// plain from the method's description: the methods registered host memory does without.
    pub fn not_served_because(self, path: TransferPath) -> Option<&'static str> {
        if !path.involves(LocationKind::Registered) || Self::candidates(path).contains(&self) {
            return None;
        }
        match self {
            Self::ZeroCopy => Some(
                "registered host memory is page-locked but not mapped into the device's address \
                 space (registered without CU_MEMHOSTREGISTER_DEVICEMAP); use a PinnedBuffer for \
                 ZeroCopy",
            ),
            Self::HostStaged => Some(
                "registered host memory is already page-locked: the copy engine reads and writes \
                 it directly, and staging would only add a host copy",
            ),
            _ => None,
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
        for src in [Pageable, Pinned, Device, Unified, Registered] {
            for dst in [Pageable, Pinned, Device, Unified, Registered] {
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
    fn registered_paths_copy_directly_and_say_why_not_otherwise() {
        for path in [
            TransferPath::REGISTERED_TO_DEVICE,
            TransferPath::DEVICE_TO_REGISTERED,
        ] {
            assert_eq!(
                TransferMethod::candidates(path),
                &[TransferMethod::DirectCopy]
            );
            let why = TransferMethod::ZeroCopy.not_served_because(path).unwrap();
            assert!(why.contains("not mapped"), "{why}");
            assert!(
                TransferMethod::HostStaged
                    .not_served_because(path)
                    .is_some()
            );
            assert_eq!(TransferMethod::DirectCopy.not_served_because(path), None);
        }
        // Other paths give no extra reason.
        assert_eq!(
            TransferMethod::HostStaged.not_served_because(TransferPath::DEVICE_TO_DEVICE),
            None
        );
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
