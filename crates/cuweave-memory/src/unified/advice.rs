//! [`MemAdvice`]: one unified-memory hint, aimed at a device or at the host.

use std::fmt;

use cuweave_driver::memory::{Advice, MemLocation};

/// One `cuMemAdvise` hint about a managed range.
///
/// Advice never changes the data, only where the driver keeps and maps its pages. On CUDA
/// 12.2+ drivers it goes through `cuMemAdvise_v2` with a `CUmemLocation`; on older ones through
/// `cuMemAdvise` with a device ordinal (`CU_DEVICE_CPU` for the host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemAdvice {
    /// The data is mostly read: every processor that reads it may keep a read-only copy; a
    /// write invalidates the other copies.
    SetReadMostly,
    /// Undo [`MemAdvice::SetReadMostly`]: one copy again.
    UnsetReadMostly,
    /// Keep the pages at this location: faults elsewhere map them remotely where possible
    /// instead of migrating them (a prefetch still moves them).
    SetPreferredLocation(MemLocation),
    /// Forget the preferred location.
    UnsetPreferredLocation,
    /// This location will access the data: keep it mapped there, so its accesses do not fault.
    SetAccessedBy(MemLocation),
    /// Undo [`MemAdvice::SetAccessedBy`] for this location.
    UnsetAccessedBy(MemLocation),
}

impl MemAdvice {
    /// The driver's advice code.
    pub fn advice(&self) -> Advice {
        match self {
            Self::SetReadMostly => Advice::SetReadMostly,
            Self::UnsetReadMostly => Advice::UnsetReadMostly,
            Self::SetPreferredLocation(_) => Advice::SetPreferredLocation,
            Self::UnsetPreferredLocation => Advice::UnsetPreferredLocation,
            Self::SetAccessedBy(_) => Advice::SetAccessedBy,
            Self::UnsetAccessedBy(_) => Advice::UnsetAccessedBy,
        }
    }

    /// The location the advice is aimed at; `None` for advice whose location the driver ignores.
    pub fn location(&self) -> Option<MemLocation> {
        match self {
            Self::SetPreferredLocation(location)
            | Self::SetAccessedBy(location)
            | Self::UnsetAccessedBy(location) => Some(*location),
            Self::SetReadMostly | Self::UnsetReadMostly | Self::UnsetPreferredLocation => None,
        }
    }

    /// The arguments for the driver call: the advice, and its location (the range's own device
    /// where the driver ignores it, a value every driver accepts).
    pub(crate) fn driver_args(&self, own_device: usize) -> (Advice, MemLocation) {
        (
            self.advice(),
            self.location().unwrap_or(MemLocation::Device(own_device)),
        )
    }
}

impl fmt::Display for MemAdvice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::SetReadMostly => f.write_str("set read-mostly"),
            Self::UnsetReadMostly => f.write_str("unset read-mostly"),
            Self::SetPreferredLocation(location) => write!(f, "set preferred location {location}"),
            Self::UnsetPreferredLocation => f.write_str("unset preferred location"),
            Self::SetAccessedBy(location) => write!(f, "set accessed by {location}"),
            Self::UnsetAccessedBy(location) => write!(f, "unset accessed by {location}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case(
        MemAdvice::SetReadMostly,
        Advice::SetReadMostly,
        MemLocation::Device(2)
    )]
    #[case(
        MemAdvice::UnsetReadMostly,
        Advice::UnsetReadMostly,
        MemLocation::Device(2)
    )]
    #[case(
        MemAdvice::SetPreferredLocation(MemLocation::Host),
        Advice::SetPreferredLocation,
        MemLocation::Host
    )]
    #[case(
        MemAdvice::SetPreferredLocation(MemLocation::Device(1)),
        Advice::SetPreferredLocation,
        MemLocation::Device(1)
    )]
    #[case(
        MemAdvice::UnsetPreferredLocation,
        Advice::UnsetPreferredLocation,
        MemLocation::Device(2)
    )]
    #[case(
        MemAdvice::SetAccessedBy(MemLocation::Device(0)),
        Advice::SetAccessedBy,
        MemLocation::Device(0)
    )]
    #[case(
        MemAdvice::UnsetAccessedBy(MemLocation::Host),
        Advice::UnsetAccessedBy,
        MemLocation::Host
    )]
    fn advice_maps_to_the_driver_call(
        #[case] advice: MemAdvice,
        #[case] code: Advice,
        #[case] location: MemLocation,
    ) {
        assert_eq!(advice.driver_args(2), (code, location));
    }

    #[test]
    fn advice_displays_its_target() {
        assert_eq!(
            MemAdvice::SetPreferredLocation(MemLocation::Device(1)).to_string(),
            "set preferred location device 1"
        );
        assert_eq!(
            MemAdvice::UnsetAccessedBy(MemLocation::Host).to_string(),
            "unset accessed by host"
        );
        assert_eq!(MemAdvice::SetReadMostly.location(), None);
    }
}
