//! GPU test, alone in its binary so that no other test has calibrated the process first: a
//! calibration cached by a manager that serves fewer devices is completed, not reused as it is.

use cuweave_test_support::require_gpu;
use cuweave_transfer::{TransferManager, TransferPath};

#[test]
fn a_manager_completes_a_calibration_cached_for_fewer_devices() {
    let _gpu = require_gpu!();
    // A manager serving no device measures nothing, and that is what the process caches.
    let none = TransferManager::for_devices(&[]).unwrap();
    let empty = none.calibrate().unwrap();
    assert!(empty.entries.is_empty() && empty.staging.is_empty());
    // A manager serving every device measures each of them into that table.
    let all = TransferManager::new().unwrap();
    let table = all.calibrate().unwrap();
    for device in all.devices() {
        assert!(
            table.entries.iter().any(|e| e.path == TransferPath::PAGEABLE_TO_DEVICE
                && e.dst_device == Some(device)),
            "device {device}'s host paths were measured"
        );
        assert!(
            table.staging.iter().any(|c| c.device == device),
            "device {device}'s staging was chosen"
        );
    }
    assert!(table.registration.is_some(), "registration cost measured");
    assert_eq!(all.calibration(), table);
    // Now complete: a third manager reuses it without measuring.
    assert_eq!(TransferManager::new().unwrap().calibrate().unwrap(), table);
}
