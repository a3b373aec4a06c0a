//! [`ManagedCapabilities`]: what a device can do with managed memory, read once per device.

use cuweave_driver::memory::MemLocation;
use cuweave_driver::{Device, DriverError};

use crate::error::Result;

/// The managed-memory capabilities of one device, as the driver reports them (cached per
/// process after the first query).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ManagedCapabilities {
    /// The device's ordinal.
    pub device: usize,
    /// The device can allocate managed memory (`CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY`).
    pub managed_memory: bool,
    /// Host and device may access managed memory concurrently
    /// (`CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS`); prefetching, and advice aimed at the
    /// device, need it.
    pub concurrent_managed_access: bool,
}

impl ManagedCapabilities {
    /// The capabilities of `device`, from the driver layer's per-device cache
    /// ([`Device::managed_support`]), which the driver's own checks share.
    pub fn of(device: Device) -> Result<Self> {
        let support = device.managed_support()?;
        Ok(Self {
            device: device.ordinal(),
            managed_memory: support.managed_memory,
            concurrent_managed_access: support.concurrent_managed_access,
        })
    }

    /// `CapabilityMissing { capability: "managed memory" }` unless the device has it.
    pub fn require_managed_memory(&self, operation: &'static str) -> Result<()> {
        if self.managed_memory {
            Ok(())
        } else {
            Err(self.missing("managed memory", operation))
        }
    }

    /// `CapabilityMissing` naming managed memory or concurrent managed access, whichever the
    /// device lacks first.
    pub fn require_concurrent_managed_access(&self, operation: &'static str) -> Result<()> {
        self.require_managed_memory(operation)?;
        if self.concurrent_managed_access {
            Ok(())
        } else {
            Err(self.missing("concurrent managed access", operation))
        }
    }

    fn missing(&self, capability: &'static str, operation: &'static str) -> crate::MemoryError {
        DriverError::CapabilityMissing {
            capability,
            device: self.device,
            operation,
        }
        .into()
    }
}

/// An `InvalidArgument` error unless device `ordinal` exists (there are `count` devices).
pub(crate) fn check_ordinal(ordinal: usize, count: usize, operation: &'static str) -> Result<()> {
    if ordinal < count {
        Ok(())
    } else {
        Err(DriverError::InvalidArgument {
            operation,
            reason: format!("target device {ordinal} does not exist: {count} device(s) present"),
        }
        .into())
    }
}

/// Checks that a location a hint or prefetch aims at exists and, for a device, has concurrent
/// managed access (the driver requires it of any device named as preferred location,
/// accessor or prefetch target).
pub(crate) fn check_target(location: MemLocation, operation: &'static str) -> Result<()> {
    match location {
        MemLocation::Host => Ok(()),
        MemLocation::Device(ordinal) => {
            check_ordinal(ordinal, Device::count()?, operation)?;
            ManagedCapabilities::of(Device::get(ordinal)?)?
                .require_concurrent_managed_access(operation)
        }
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;
    use crate::MemoryError;

    fn caps(managed_memory: bool, concurrent_managed_access: bool) -> ManagedCapabilities {
        ManagedCapabilities {
            device: 3,
            managed_memory,
            concurrent_managed_access,
        }
    }

    fn missing(error: MemoryError) -> &'static str {
        match error {
            MemoryError::Driver(DriverError::CapabilityMissing {
                capability,
                device: 3,
                operation: "op",
            }) => capability,
            other => panic!("expected CapabilityMissing, got {other:?}"),
        }
    }

    #[rstest]
    #[case::full(true, true, None, None)]
    #[case::no_concurrency(true, false, None, Some("concurrent managed access"))]
    #[case::nothing(false, false, Some("managed memory"), Some("managed memory"))]
    fn missing_capabilities_are_named(
        #[case] managed: bool,
        #[case] concurrent: bool,
        #[case] for_advice: Option<&str>,
        #[case] for_prefetch: Option<&str>,
    ) {
        let caps = caps(managed, concurrent);
        assert_eq!(
            caps.require_managed_memory("op").err().map(missing),
            for_advice
        );
        assert_eq!(
            caps.require_concurrent_managed_access("op")
                .err()
                .map(missing),
            for_prefetch
        );
    }

    #[test]
    fn ordinals_past_the_device_count_are_refused() {
        assert!(check_ordinal(0, 1, "op").is_ok());
        let error = check_ordinal(4, 2, "op").unwrap_err();
        assert!(matches!(
            &error,
            MemoryError::Driver(DriverError::InvalidArgument { operation: "op", reason })
                if reason.contains("device 4") && reason.contains("2 device")
        ));
        assert!(check_target(MemLocation::Host, "op").is_ok());
    }
}
