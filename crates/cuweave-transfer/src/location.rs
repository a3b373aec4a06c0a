//! Where bytes live ([`Location`]), the path between two places ([`TransferPath`]) and the size
//! classes statistics and calibration are kept per ([`SizeClass`]).

use std::fmt;

use serde::{Deserialize, Serialize};

/// A place bytes can be moved from or to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Location {
    /// Ordinary (pageable) host memory: `&[T]`, `Vec<T>`.
    PageableHost,
    /// Page-locked host memory ([`PinnedBuffer`](cuweave_memory::PinnedBuffer)), mapped into the
    /// address space of the device whose context allocated it (the ordinal).
    PinnedHost(usize),
    /// Memory of one device ([`DeviceBuffer`](cuweave_memory::DeviceBuffer)).
    Device(usize),
    /// The caller's own host memory page-locked in place
    /// ([`RegisteredHost`](crate::RegisteredHost)), registered in the context of the device with
    /// this ordinal (portable: every device DMAs it directly).
    RegisteredHost(usize),
    /// Managed memory ([`UnifiedBuffer`](cuweave_memory::UnifiedBuffer)) allocated in the
    /// context of the device with this ordinal.
    Unified(usize),
}

impl Location {
    /// The kind of memory, without the device.
    pub fn kind(self) -> LocationKind {
        match self {
            Self::PageableHost => LocationKind::Pageable,
            Self::PinnedHost(_) => LocationKind::Pinned,
            Self::Device(_) => LocationKind::Device,
            Self::Unified(_) => LocationKind::Unified,
            Self::RegisteredHost(_) => LocationKind::Registered,
        }
    }

    /// The device the memory belongs to (or is mapped for); `None` for pageable host memory.
    pub fn device(self) -> Option<usize> {
        match self {
            Self::PageableHost => None,
            Self::PinnedHost(d) | Self::Device(d) | Self::Unified(d) | Self::RegisteredHost(d) => {
                Some(d)
            }
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PageableHost => f.write_str("pageable host"),
            Self::PinnedHost(d) => write!(f, "pinned host (device {d})"),
            Self::Device(d) => write!(f, "device {d}"),
            Self::Unified(d) => write!(f, "unified (device {d})"),
            Self::RegisteredHost(d) => write!(f, "registered host (device {d})"),
        }
    }
}

/// The kind of memory at a [`Location`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LocationKind {
    /// Pageable host memory.
    Pageable,
    /// Pinned host memory.
    Pinned,
    /// Device memory.
    Device,
    /// Managed (unified) memory.
    Unified,
    /// Host memory registered in place (`cuMemHostRegister`).
    Registered,
}

impl LocationKind {
    /// The lower-case name used in paths and JSON (`pageable`, `pinned`, `device`, `unified`,
    /// `registered`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Pageable => "pageable",
            Self::Pinned => "pinned",
            Self::Device => "device",
            Self::Unified => "unified",
            Self::Registered => "registered",
        }
    }
}

/// The shape of a transfer: the kinds of memory on each side, and whether two devices are
/// involved. Statistics and calibration are kept per path (and [`SizeClass`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TransferPath {
    /// The source's kind of memory.
    pub src: LocationKind,
    /// The destination's kind of memory.
    pub dst: LocationKind,
    /// Whether source and destination belong to different devices (pageable memory belongs to
    /// none, so a path with a pageable side is never cross-device).
    pub cross_device: bool,
}

impl TransferPath {
    /// The path from `src` to `dst`.
    pub fn between(src: Location, dst: Location) -> Self {
        let cross_device = matches!((src.device(), dst.device()), (Some(a), Some(b)) if a != b);
        Self {
            src: src.kind(),
            dst: dst.kind(),
            cross_device,
        }
    }

    /// A path on one device (or with a host side).
    pub const fn local(src: LocationKind, dst: LocationKind) -> Self {
        Self {
            src,
            dst,
            cross_device: false,
        }
    }

    /// Whether either side is memory of `kind`.
    pub fn involves(self, kind: LocationKind) -> bool {
        self.src == kind || self.dst == kind
    }

    /// Pageable host to device: the path pipelined staging serves.
    pub const PAGEABLE_TO_DEVICE: Self = Self::local(LocationKind::Pageable, LocationKind::Device);
    /// Device to pageable host.
    pub const DEVICE_TO_PAGEABLE: Self = Self::local(LocationKind::Device, LocationKind::Pageable);
    /// Pinned host to device.
    pub const PINNED_TO_DEVICE: Self = Self::local(LocationKind::Pinned, LocationKind::Device);
    /// Device to pinned host.
    pub const DEVICE_TO_PINNED: Self = Self::local(LocationKind::Device, LocationKind::Pinned);
    /// Registered host to device: a direct DMA from the caller's page-locked memory.
    pub const REGISTERED_TO_DEVICE: Self =
        Self::local(LocationKind::Registered, LocationKind::Device);
    /// Device to registered host.
    pub const DEVICE_TO_REGISTERED: Self =
        Self::local(LocationKind::Device, LocationKind::Registered);
    /// Within one device.
    pub const DEVICE_TO_DEVICE: Self = Self::local(LocationKind::Device, LocationKind::Device);
    /// Between two devices.
    pub const PEER: Self = Self {
        src: LocationKind::Device,
        dst: LocationKind::Device,
        cross_device: true,
    };
}

impl fmt::Display for TransferPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.src.name(), self.dst.name())?;
        if self.cross_device {
            f.write_str(" (other device)")?;
        }
        Ok(())
    }
}

/// A range of transfer sizes that statistics and calibration treat alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SizeClass {
    /// Up to 64 KiB: latency-bound; the plain call is the one to beat.
    Tiny,
    /// Over 64 KiB, up to 1 MiB.
    Small,
    /// Over 1 MiB, up to 16 MiB.
    Medium,
    /// Over 16 MiB, up to 256 MiB.
    Large,
    /// Over 256 MiB.
    Huge,
}

impl SizeClass {
    /// Every class, smallest first.
    pub const ALL: [Self; 5] = [
        Self::Tiny,
        Self::Small,
        Self::Medium,
        Self::Large,
        Self::Huge,
    ];

    /// The class of a transfer of `bytes` bytes.
    pub fn of(bytes: usize) -> Self {
        const MIB: usize = 1 << 20;
        match bytes {
            0..=65_536 => Self::Tiny,
            b if b <= MIB => Self::Small,
            b if b <= 16 * MIB => Self::Medium,
            b if b <= 256 * MIB => Self::Large,
            _ => Self::Huge,
        }
    }

    /// The one size that stands for the class where a figure carries no size of its own: a
    /// figure recorded by class (`CalibrationTable::record`), and every entry of a table
    /// written before entries recorded their size, when calibration measured each class once.
    /// Its upper bound, except `Large` and `Huge`, both 64 MiB as they were measured then.
    /// [`calibrate`](crate::TransferManager::calibrate) now measures each of
    /// [`CALIBRATION_SIZES`](crate::CALIBRATION_SIZES).
    pub fn calibration_bytes(self) -> usize {
        match self {
            Self::Tiny => 64 << 10,
            Self::Small => 1 << 20,
            Self::Medium => 16 << 20,
            Self::Large | Self::Huge => 64 << 20,
        }
    }

    /// A short label: `<=64KiB`, `<=1MiB`, `<=16MiB`, `<=256MiB`, `>256MiB`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Tiny => "<=64KiB",
            Self::Small => "<=1MiB",
            Self::Medium => "<=16MiB",
            Self::Large => "<=256MiB",
            Self::Huge => ">256MiB",
        }
    }
}

impl fmt::Display for SizeClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case(0, SizeClass::Tiny)]
    #[case(65_536, SizeClass::Tiny)]
    #[case(65_537, SizeClass::Small)]
    #[case(1 << 20, SizeClass::Small)]
    #[case((1 << 20) + 3, SizeClass::Medium)]
    #[case(16 << 20, SizeClass::Medium)]
    #[case(256 << 20, SizeClass::Large)]
    #[case((256 << 20) + 1, SizeClass::Huge)]
    fn sizes_fall_in_their_class(#[case] bytes: usize, #[case] class: SizeClass) {
        assert_eq!(SizeClass::of(bytes), class);
    }

    #[test]
    fn paths_know_when_two_devices_are_involved() {
        let p = TransferPath::between(Location::Device(0), Location::Device(1));
        assert_eq!(p, TransferPath::PEER);
        assert_eq!(p.to_string(), "device -> device (other device)");
        let p = TransferPath::between(Location::PageableHost, Location::Device(1));
        assert_eq!(p, TransferPath::PAGEABLE_TO_DEVICE);
        let p = TransferPath::between(Location::PinnedHost(0), Location::Device(1));
        assert!(p.cross_device);
        assert_eq!(
            TransferPath::between(Location::Unified(2), Location::Unified(2)).to_string(),
            "unified -> unified"
        );
        let p = TransferPath::between(Location::RegisteredHost(0), Location::Device(0));
        assert_eq!(p, TransferPath::REGISTERED_TO_DEVICE);
        assert!(p.involves(LocationKind::Registered) && !p.involves(LocationKind::Pinned));
        assert_eq!(p.to_string(), "registered -> device");
        assert_eq!(Location::RegisteredHost(1).device(), Some(1));
    }
}
