//! Adversarial probes of the rule "bad input gets a clear typed error, never a panic, never lost
//! data, never UB" in the transfer layer: zero-byte transfers, mismatched lengths, ranges past
//! the end, downloads into short slices, managers for no device or a device that does not
//! exist, staging configurations and calibration tables that cannot be right, async transfers
//! dropped or forgotten at once.

mod common;
use common::block_on;

use std::future::Future;
use std::task::{Context, Waker};

use cuweave_memory::{Buffer, DeviceBuffer};
use cuweave_test_support::{require_gpu, serial};
use cuweave_transfer::{
    CalibrationTable, Destination, HostCopy, SizeClass, Source, StagingChoice, StagingConfig,
    TransferError, TransferManager, TransferMethod, TransferPath,
};

fn pattern(len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(0x9E37_79B9) ^ 0x5A5A)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// CPU-only.
// ---------------------------------------------------------------------------------------------

#[test]
fn staging_configs_out_of_bounds_are_invalid_staging_before_any_driver_call() {
    let good = StagingConfig::for_upload(1 << 20);
    assert!(good.validate().is_ok());
    for bad in [
        StagingConfig {
            chunk_bytes: 0,
            ..good
        },
        StagingConfig {
            chunk_bytes: usize::MAX,
            ..good
        },
        StagingConfig { depth: 0, ..good },
        StagingConfig {
            depth: usize::MAX,
            ..good
        },
        StagingConfig { threads: 0, ..good },
        StagingConfig {
            threads: usize::MAX,
            ..good
        },
    ] {
        assert!(
            matches!(bad.validate(), Err(TransferError::InvalidStaging { .. })),
            "{bad:?}"
        );
        // `with_staging` validates first, so this holds with or without a driver.
        assert!(
            matches!(
                TransferManager::with_staging(bad),
                Err(TransferError::InvalidStaging { .. })
            ),
            "{bad:?}"
        );
        // Helpers on an invalid config still do not panic or overflow.
        let _ = bad.staging_bytes();
        let _ = bad.workers(usize::MAX);
        let _ = bad.chunk_elements::<u64>();
    }
}

#[test]
fn malformed_calibration_json_is_a_calibration_file_error() {
    let defaults = CalibrationTable::h100_defaults().to_json();
    let negative = defaults.replacen("\"gbps\": ", "\"gbps\": -", 1);
    assert_ne!(negative, defaults, "the defaults name a bandwidth");
    let huge = defaults.replacen("\"gbps\": ", "\"gbps\": 1e999", 1);
    for (what, json) in [
        ("empty", String::new()),
        ("not json", "{{{".to_owned()),
        ("an array", "[]".to_owned()),
        ("null", "null".to_owned()),
        ("truncated", defaults[..defaults.len() / 2].to_owned()),
        ("negative bandwidth", negative),
        ("infinite bandwidth", huge),
        (
            "string bandwidth",
            defaults.replacen("\"gbps\": ", "\"gbps\": \"fast\", \"x\": ", 1),
        ),
    ] {
        let got = CalibrationTable::from_json(&json);
        assert!(
            matches!(got, Err(TransferError::CalibrationFile { .. })),
            "{what}: {:?}",
            got.map(|t| t.is_empty())
        );
    }
    let missing = std::env::temp_dir().join("cuweave-bad-input-probes/none/calibration.json");
    assert!(matches!(
        CalibrationTable::load(&missing),
        Err(TransferError::CalibrationFile { .. })
    ));
    assert!(CalibrationTable::from_json(&defaults).is_ok());
}

// A staging choice in a file with a chunk of 0 bytes (which would queue endless chunks) is
// refused on load.
#[test]
fn a_calibration_file_naming_an_impossible_staging_config_is_refused() {
    let mut table = CalibrationTable::h100_defaults();
    table.record_staging(StagingChoice {
        path: upload_path(),
        device: 0,
        bytes: 1 << 20,
        config: StagingConfig::for_upload(1 << 20),
        gbps: 20.0,
    });
    let json = table.to_json();
    assert!(CalibrationTable::from_json(&json).is_ok());
    for (key, value) in [
        ("\"chunk_bytes\": ", "0"),
        ("\"chunk_bytes\": ", "18446744073709551615"),
        ("\"depth\": ", "0"),
        ("\"threads\": ", "100000"),
    ] {
        let bad = regex_like_replace(&json, key, value);
        assert_ne!(bad, json, "{key}");
        let got = CalibrationTable::from_json(&bad);
        assert!(
            matches!(got, Err(TransferError::CalibrationFile { .. })),
            "{key}{value}: {:?}",
            got.map(|t| t.is_empty())
        );
    }
}

fn upload_path() -> TransferPath {
    TransferPath::between(
        cuweave_transfer::Location::PageableHost,
        cuweave_transfer::Location::Device(0),
    )
}

/// `json` with the number after the first `key` replaced by `value`.
fn regex_like_replace(json: &str, key: &str, value: &str) -> String {
    let Some(at) = json.find(key) else {
        return json.to_owned();
    };
    let start = at + key.len();
    let end = start
        + json[start..]
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(json.len() - start);
    format!("{}{value}{}", &json[..start], &json[end..])
}

// `record` takes any f64: a NaN or negative figure stored as given would make a table the
// program saves impossible to load back (serde_json writes NaN as `null`, and `from_json`
// refuses negative figures), losing the table's measurements. Such a figure is left out.
#[test]
fn a_table_with_a_nonsense_recorded_figure_still_round_trips_or_refuses_the_figure() {
    for figure in [f64::NAN, -1.0, f64::INFINITY, f64::MAX] {
        let mut table = CalibrationTable::h100_defaults();
        table.record(
            upload_path(),
            SizeClass::of(1 << 20),
            TransferMethod::DirectCopy,
            figure,
        );
        let back = CalibrationTable::from_json(&table.to_json());
        assert!(back.is_ok(), "{figure}: {:?}", back.err());
    }
}

// ---------------------------------------------------------------------------------------------
// GPU.
// ---------------------------------------------------------------------------------------------

#[test]
fn managers_for_no_device_or_a_missing_device_refuse_typed() {
    let _serial = serial();
    let gpu = require_gpu!();
    let got = TransferManager::for_devices(&[4096]);
    assert!(
        matches!(got, Err(TransferError::NoSuchDevice { device: 4096, .. })),
        "{:?}",
        got.map(|m| m.device_count())
    );
    let got = TransferManager::for_devices(&[0, usize::MAX]);
    assert!(matches!(
        got,
        Err(TransferError::NoSuchDevice {
            device: usize::MAX,
            ..
        })
    ));

    let none = TransferManager::for_devices(&[]).unwrap();
    assert!(!none.is_open(0));
    let data = pattern(1024);
    let mut device = DeviceBuffer::from_slice(&gpu.context, &data).unwrap();
    let mut host = vec![0u32; data.len()];
    let got = none.transfer(&device, &mut host[..]);
    assert!(
        matches!(got, Err(TransferError::NoSuchDevice { device: 0, .. })),
        "{got:?}"
    );
    assert!(host.iter().all(|&x| x == 0));
    let got = none.upload_async(&data, &mut device, 0).map(drop);
    assert!(
        matches!(got, Err(TransferError::NoSuchDevice { device: 0, .. })),
        "{got:?}"
    );
    let owned = block_on(none.upload_owned(data.clone(), device, 0));
    assert!(
        matches!(owned.result, Err(TransferError::NoSuchDevice { .. })),
        "{:?}",
        owned.result
    );
    assert_eq!(
        owned.host, data,
        "the refused upload's host side came back intact"
    );
    assert_eq!(owned.device.to_vec().unwrap(), data);
}

#[test]
fn zero_byte_and_mismatched_transfers_are_typed_and_touch_nothing() {
    let _serial = serial();
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let data = pattern(256);
    let mut device = DeviceBuffer::from_slice(&gpu.context, &data).unwrap();

    // Zero elements at the very end: accepted, no bytes.
    let report = manager
        .transfer(Source::Host(&[]), Destination::device(&mut device, 256))
        .unwrap();
    assert_eq!(report.bytes, 0);
    // Zero elements past the end: the offset is still checked.
    let got = manager.transfer(Source::Host(&[]), Destination::device(&mut device, 257));
    assert!(
        matches!(got, Err(TransferError::OutOfRange { .. })),
        "{got:?}"
    );
    // A source range past the end, one whose end overflows, and a short host destination.
    let mut host = vec![7u32; 10];
    let got = manager.transfer(Source::device(&device, 250, 10), &mut host[..]);
    assert!(
        matches!(got, Err(TransferError::OutOfRange { capacity: 256, .. })),
        "{got:?}"
    );
    let got = manager.transfer(Source::device(&device, usize::MAX, 2), &mut host[..]);
    assert!(
        matches!(got, Err(TransferError::OutOfRange { .. })),
        "{got:?}"
    );
    let got = manager.transfer(&device, &mut host[..]);
    assert!(
        matches!(
            got,
            Err(TransferError::LengthMismatch {
                source_len: 256,
                destination_len: 10
            })
        ),
        "{got:?}"
    );
    assert_eq!(host, vec![7; 10], "a refused download wrote the host slice");
    let long = pattern(300);
    let got = manager.transfer(&long, Destination::device(&mut device, 0));
    assert!(
        matches!(got, Err(TransferError::OutOfRange { .. })),
        "{got:?}"
    );
    for method in [
        TransferMethod::DirectCopy,
        TransferMethod::HostStaged,
        TransferMethod::ZeroCopy,
    ] {
        let got = manager.transfer_with(method, &long, Destination::device(&mut device, 0));
        assert!(
            matches!(got, Err(TransferError::OutOfRange { .. })),
            "{method:?}: {got:?}"
        );
    }
    assert_eq!(device.to_vec().unwrap(), data);
    // A method that cannot serve the path is `Unsupported`, not a panic.
    let mut back = vec![0u32; 256];
    let got = manager.transfer_with(TransferMethod::PeerToPeer, &device, &mut back[..]);
    assert!(
        matches!(got, Err(TransferError::Unsupported { .. })),
        "{got:?}"
    );
    manager.transfer(&device, &mut back[..]).unwrap();
    assert_eq!(back, data);
}

#[test]
fn async_transfers_with_bad_ranges_are_refused_and_dropped_ones_leave_consistent_memory() {
    let _serial = serial();
    let gpu = require_gpu!();
    let manager = TransferManager::with_staging(StagingConfig {
        chunk_bytes: 64 << 10,
        depth: 2,
        threads: 2,
        host_copy: HostCopy::Streaming,
        ..StagingConfig::for_upload(1 << 20)
    })
    .unwrap();
    let len = 1 << 20;
    let data = pattern(len);
    let mut device = DeviceBuffer::<u32>::zeroed(&gpu.context, len).unwrap();

    let got = manager.upload_async(&data, &mut device, 1).map(drop);
    assert!(
        matches!(got, Err(TransferError::OutOfRange { .. })),
        "{got:?}"
    );
    let got = manager
        .upload_async(&data[..0], &mut device, len + 1)
        .map(drop);
    assert!(
        matches!(got, Err(TransferError::OutOfRange { .. })),
        "{got:?}"
    );
    let mut short = vec![0u32; 10];
    let got = manager
        .download_async(&device, len - 5, &mut short)
        .map(drop);
    assert!(
        matches!(got, Err(TransferError::OutOfRange { .. })),
        "{got:?}"
    );
    assert!(short.iter().all(|&x| x == 0));

    // Dropped before its first poll, and forgotten: neither may leave work that writes memory
    // after it is gone, and the buffer stays usable.
    drop(manager.upload_async(&data, &mut device, 0).unwrap());
    std::mem::forget(manager.upload_async(&data, &mut device, 0).unwrap());
    let mut partial = Box::pin(manager.upload_async(&data, &mut device, 0).unwrap());
    let waker = Waker::noop();
    let _ = partial.as_mut().poll(&mut Context::from_waker(waker));
    drop(partial);

    let owned = manager.upload_owned(data.clone(), device, 0);
    drop(owned); // runs to the end in the background, then frees both buffers

    let mut fresh = DeviceBuffer::<u32>::zeroed(&gpu.context, len).unwrap();
    block_on(manager.upload_async(&data, &mut fresh, 0).unwrap()).unwrap();
    let mut back = vec![0u32; len];
    block_on(manager.download_async(&fresh, 0, &mut back).unwrap()).unwrap();
    assert_eq!(back, data);
}

// `download_owned` into a `Vec` shorter than the buffer downloads a prefix (its documented
// meaning); into one longer than what remains past the offset it is `OutOfRange` and both
// buffers come back untouched.
#[test]
fn owned_downloads_into_a_longer_vec_than_remains_hand_both_buffers_back() {
    let _serial = serial();
    let gpu = require_gpu!();
    let manager = TransferManager::new().unwrap();
    let data = pattern(4096);
    let device = DeviceBuffer::from_slice(&gpu.context, &data).unwrap();
    let owned = block_on(manager.download_owned(device, 4000, vec![1u32; 97]));
    assert!(
        matches!(owned.result, Err(TransferError::OutOfRange { .. })),
        "{:?}",
        owned.result
    );
    assert_eq!(owned.host, vec![1u32; 97]);
    let owned = block_on(manager.download_owned(owned.device, 4000, vec![0u32; 96]));
    owned.result.unwrap();
    assert_eq!(owned.host, &data[4000..]);
    assert_eq!(owned.device.to_vec().unwrap(), data);
}
