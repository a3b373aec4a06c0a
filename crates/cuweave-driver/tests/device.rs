//! Device queries on a real GPU: what the driver reports is present, plausible and consistent.

use cuweave_driver::{ComputeCapability, Context, Device, DriverError, driver_version, sys};
use cuweave_test_support::require_gpu;

const GIB: usize = 1 << 30;

#[test]
fn device_zero_reports_plausible_properties() {
    let gpu = require_gpu!();
    let device = gpu.device;
    let count = Device::count().unwrap();
    assert!(count >= 1);
    assert_eq!(device.ordinal(), 0);

    let name = device.name().unwrap();
    assert!(!name.trim().is_empty(), "empty device name");
    let total = device.total_memory().unwrap();
    assert!(total > GIB, "only {total} bytes of device memory");
    let capability = device.compute_capability().unwrap();
    eprintln!(
        "device 0: {name}, compute capability {capability}, {} GiB, PCI {}",
        total / GIB,
        device.pci_bus_id().unwrap()
    );
    // The test kernels are PTX for compute_75, so anything older could not run the other tests.
    assert!(
        capability >= ComputeCapability { major: 7, minor: 5 },
        "compute capability {capability}"
    );

    let bus_id = device.pci_bus_id().unwrap();
    // Domain:bus:device.function, e.g. 0000:1B:00.0.
    assert!(bus_id.contains(':') && bus_id.contains('.'), "{bus_id:?}");

    let version = driver_version().unwrap();
    eprintln!(
        "driver supports CUDA {}.{}",
        version / 1000,
        version % 1000 / 10
    );
    assert!(version >= 12000, "driver version {version}");
}

#[test]
fn capabilities_agree_with_the_individual_queries() {
    let gpu = require_gpu!();
    let device = gpu.device;
    let caps = device.capabilities().unwrap();
    eprintln!("{caps:?}");
    assert_eq!(
        caps.managed_memory,
        device.supports_managed_memory().unwrap()
    );
    assert_eq!(
        caps.concurrent_managed_access,
        device.supports_concurrent_managed_access().unwrap()
    );
    assert_eq!(
        caps.pageable_memory_access,
        device.supports_pageable_memory_access().unwrap()
    );
    assert_eq!(
        caps.memory_pools_supported,
        device.supports_memory_pools().unwrap()
    );
    assert_eq!(
        caps.unified_addressing,
        device.supports_unified_addressing().unwrap()
    );
    assert_eq!(
        caps.can_map_host_memory,
        device.can_map_host_memory().unwrap()
    );
    assert_eq!(
        caps.async_engine_count,
        device.async_engine_count().unwrap()
    );
    let sms = device
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .unwrap();
    assert_eq!(i64::from(caps.multiprocessor_count), i64::from(sms));
    assert!(caps.multiprocessor_count > 0);
    // Every GPU that can run our compute_75 kernels has at least one copy engine.
    assert!(caps.async_engine_count >= 1);

    let capability = device.compute_capability().unwrap();
    assert_eq!(
        i64::from(capability.major),
        i64::from(
            device
                .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                .unwrap()
        )
    );
    // On 64-bit Linux every device from Volta on has unified addressing, can map pinned host
    // memory, allocates managed memory and has stream-ordered pools; the upper layers rely on it.
    if cfg!(target_os = "linux") && capability >= (ComputeCapability { major: 7, minor: 0 }) {
        assert!(caps.unified_addressing);
        assert!(caps.can_map_host_memory);
        assert!(caps.managed_memory);
        assert!(caps.memory_pools_supported);
    }
}

#[test]
fn ordinals_handles_and_the_device_list_agree() {
    let gpu = require_gpu!();
    let count = Device::count().unwrap();
    let all = Device::all().unwrap();
    assert_eq!(all.len(), count);
    for (ordinal, device) in all.iter().enumerate() {
        assert_eq!(device.ordinal(), ordinal);
        assert_eq!(Device::get(ordinal).unwrap(), *device);
        assert_eq!(Device::from_raw(device.as_raw()).unwrap(), *device);
    }
    assert_eq!(all[0], gpu.device);
    match Device::get(count) {
        Err(DriverError::InvalidArgument { operation, reason }) => {
            assert_eq!(operation, "Device::get");
            assert!(reason.contains(&count.to_string()), "{reason}");
        }
        other => panic!("ordinal {count} of {count} devices gave {other:?}"),
    }
    assert!(matches!(
        Device::from_raw(-1),
        Err(DriverError::InvalidArgument { .. })
    ));
}

#[test]
fn context_reports_priorities_and_memory_of_its_device() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    assert_eq!(context.device(), gpu.device);

    let range = context.stream_priority_range().unwrap();
    eprintln!(
        "stream priorities: {} (highest) ..= {} (lowest)",
        range.greatest, range.least
    );
    assert!(range.greatest <= range.least, "{range:?}");
    assert!(range.contains(range.greatest) && range.contains(range.least));

    let info = context.memory_info().unwrap();
    assert_eq!(info.total, gpu.device.total_memory().unwrap());
    assert!(info.free > 0 && info.free <= info.total, "{info:?}");

    // A second retain of the primary context is the same driver context.
    let again = Context::primary(gpu.device).unwrap();
    assert_eq!(again.as_raw(), context.as_raw());
}
