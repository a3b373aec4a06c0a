//! GPU test of lazy devices, alone in its binary so that nothing else in the process has made a
//! context first: constructing a manager, planning and reading device facts make no context;
//! the first transfer through the manager opens the device.

use cuweave_driver::Device;
use cuweave_memory::{Buffer, DeviceBuffer, PinnedBuffer};
use cuweave_test_support::require_gpu;
use cuweave_transfer::{
    Destination, Location, Source, TransferError, TransferManager, TransferMethod, TransferPath,
};

#[test]
fn a_manager_opens_a_device_only_on_its_first_transfer() {
    // Before anything in this process makes a context (the GPU gate below makes one).
    let count = if cuweave_driver::is_available() {
        Device::count().unwrap_or(0)
    } else {
        0
    };
    let manager = if count > 0 {
        let device = Device::get(0).unwrap();
        assert!(
            !device.primary_context_active().unwrap(),
            "a context was active before the test made anything"
        );
        let manager = TransferManager::new().unwrap();
        let limited = TransferManager::for_devices(&[0]).unwrap();
        assert_eq!(limited.devices(), vec![0]);
        assert!(matches!(
            TransferManager::for_devices(&[count]),
            Err(TransferError::NoSuchDevice { device, .. }) if device == count
        ));
        let plan = manager.plan(Location::PageableHost, Location::Device(0), 4 << 20);
        assert_eq!(plan.path, TransferPath::PAGEABLE_TO_DEVICE);
        let _ = manager.facts(Location::PinnedHost(0), Location::Device(0));
        assert_eq!(manager.machine().len(), count);
        assert_eq!(manager.device_count(), count);
        assert!(
            !device.primary_context_active().unwrap(),
            "constructing, planning or reading facts made a context"
        );
        assert!((0..count).all(|d| !manager.is_open(d)));
        Some(manager)
    } else {
        None
    };
    let gpu = require_gpu!();
    let manager = manager.unwrap_or_else(|| TransferManager::new().unwrap());
    assert!(!manager.is_open(0));
    let data: Vec<u8> = (0..(8 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    let mut device = DeviceBuffer::<u8>::zeroed(&gpu.context, data.len()).unwrap();
    manager
        .transfer_with(
            TransferMethod::HostStaged,
            &data,
            Destination::device(&mut device, 0),
        )
        .unwrap();
    assert_eq!(device.to_vec().unwrap(), data);
    assert!(manager.is_open(0), "the staged transfer opened device 0");
    assert!((1..manager.device_count()).all(|d| !manager.is_open(d)));

    // A manager that serves no device refuses its staged paths but never touches the device.
    let none = TransferManager::for_devices(&[]).unwrap();
    assert!(matches!(
        none.transfer_with(
            TransferMethod::HostStaged,
            &data,
            Destination::device(&mut device, 0)
        ),
        Err(TransferError::NoSuchDevice { device: 0, .. })
    ));
    // Every other path too, whatever its method: a copy between two buffers of device 0, a
    // pinned upload, a small pageable one and an empty one; nothing lands.
    let mut other = DeviceBuffer::<u8>::zeroed(&gpu.context, data.len()).unwrap();
    let mut pinned = PinnedBuffer::<u8>::zeroed(&gpu.context, 4096).unwrap();
    pinned.as_mut_slice().unwrap().fill(9);
    let refused = |result: Result<_, TransferError>| {
        matches!(
            result,
            Err(TransferError::NoSuchDevice {
                device: 0,
                count: 0
            })
        )
    };
    assert!(refused(none.transfer(&device, &mut other)));
    assert!(refused(none.transfer(
        Source::pinned(&pinned, 0, 4096),
        Destination::device(&mut other, 0)
    )));
    assert!(refused(
        none.transfer(&data[..4096], Destination::device(&mut other, 0))
    ));
    assert!(refused(
        none.transfer(&data[..0], Destination::device(&mut other, 0))
    ));
    assert!(refused(
        none.transfer(Source::device(&device, 0, 16), &mut [0u8; 16][..])
    ));
    // A forced method too, even one the unserved device's facts would call unsupported.
    for method in [TransferMethod::ZeroCopy, TransferMethod::DirectCopy] {
        assert!(refused(none.transfer_with(
            method,
            Source::pinned(&pinned, 0, 4096),
            Destination::device(&mut other, 0)
        )));
    }
    assert_eq!(other.to_vec().unwrap(), vec![0; data.len()]);
    assert!(
        none.stats().snapshot().is_empty(),
        "a refused transfer is not counted"
    );
}
