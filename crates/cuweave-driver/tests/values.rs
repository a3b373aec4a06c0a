//! The plain values of the driver API, through its public surface: priority ranges, compute
//! capabilities, flags, memory locations and launch shapes. No GPU needed.

use cuweave_driver::memory::{HostAllocFlags, MemLocation};
use cuweave_driver::{
    ComputeCapability, DriverError, EventFlags, KernelArgs, LaunchConfig, StreamFlags,
    StreamPriorityRange, sys,
};
use rstest::rstest;

/// The range an H100 reports: 0 is the lowest priority, -5 the highest.
const H100_RANGE: StreamPriorityRange = StreamPriorityRange {
    least: 0,
    greatest: -5,
};

#[rstest]
#[case::highest(-5, true, -5)]
#[case::lowest(0, true, 0)]
#[case::inside(-2, true, -2)]
#[case::above_the_highest(-6, false, -5)]
#[case::below_the_lowest(1, false, 0)]
#[case::far_out(i32::MIN, false, -5)]
fn priority_range_contains_and_clamps(
    #[case] priority: i32,
    #[case] inside: bool,
    #[case] clamped: i32,
) {
    assert_eq!(H100_RANGE.contains(priority), inside);
    assert_eq!(H100_RANGE.clamp(priority), clamped);
}

#[test]
fn a_single_priority_range_holds_only_its_value() {
    let flat = StreamPriorityRange {
        least: 0,
        greatest: 0,
    };
    assert!(flat.contains(0));
    assert!(!flat.contains(-1));
    assert_eq!(flat.clamp(-7), 0);
}

#[rstest]
#[case::hopper_over_ampere(ComputeCapability { major: 9, minor: 0 }, ComputeCapability { major: 8, minor: 9 })]
#[case::minor_counts(ComputeCapability { major: 7, minor: 5 }, ComputeCapability { major: 7, minor: 0 })]
fn compute_capabilities_order_by_major_then_minor(
    #[case] newer: ComputeCapability,
    #[case] older: ComputeCapability,
) {
    assert!(newer > older);
}

#[test]
fn compute_capability_displays_as_major_dot_minor() {
    assert_eq!(ComputeCapability { major: 9, minor: 0 }.to_string(), "9.0");
    assert_eq!(
        ComputeCapability {
            major: 12,
            minor: 1
        }
        .to_string(),
        "12.1"
    );
}

#[test]
fn event_flags_default_to_timing_and_compose() {
    assert_eq!(EventFlags::default(), EventFlags::TIMING);
    assert!(EventFlags::TIMING.is_timing());
    assert!(!EventFlags::DISABLE_TIMING.is_timing());
    assert!(!EventFlags::TIMING.is_blocking_sync());
    let blocking = EventFlags::DISABLE_TIMING.with_blocking_sync();
    assert!(blocking.is_blocking_sync());
    assert!(
        !blocking.is_timing(),
        "blocking sync must not turn timing on"
    );
}

#[test]
fn stream_flags_default_to_the_blocking_kind() {
    assert_eq!(StreamFlags::default(), StreamFlags::DEFAULT);
    assert!(!StreamFlags::DEFAULT.is_non_blocking());
    assert!(StreamFlags::NON_BLOCKING.is_non_blocking());
}

#[test]
fn host_alloc_flags_default_to_plain_pinned_memory() {
    let plain = HostAllocFlags::default();
    assert!(!plain.portable && !plain.device_map && !plain.write_combined);
    let mapped = HostAllocFlags::PORTABLE_MAPPED;
    assert!(mapped.portable && mapped.device_map && !mapped.write_combined);
}

#[rstest]
#[case::device_zero(MemLocation::Device(0), "device 0", 0)]
#[case::device_three(MemLocation::Device(3), "device 3", 3)]
#[case::host(MemLocation::Host, "host", sys::CU_DEVICE_CPU)]
fn memory_locations_display_and_round_trip_the_legacy_form(
    #[case] location: MemLocation,
    #[case] text: &str,
    #[case] legacy: sys::CUdevice,
) {
    assert_eq!(location.to_string(), text);
    assert_eq!(location.to_legacy_device(), legacy);
    assert_eq!(MemLocation::from_legacy_device(legacy), Some(location));
}

#[test]
fn no_location_decodes_to_none() {
    assert_eq!(
        MemLocation::from_legacy_device(sys::CU_DEVICE_INVALID),
        None
    );
}

#[rstest]
#[case::exact(1024, 256, 4)]
#[case::one_past(1025, 256, 5)]
#[case::single_element(1, 256, 1)]
#[case::nothing_still_launches_one_block(0, 256, 1)]
#[case::past_the_old_cap(65_535 * 256 + 1, 256, 65_536)]
#[case::a_billion(1 << 30, 1024, 1 << 20)]
#[case::at_the_x_limit(LaunchConfig::MAX_GRID_X as usize, 1, LaunchConfig::MAX_GRID_X)]
fn launch_shapes_cover_every_element(
    #[case] elements: usize,
    #[case] block: u32,
    #[case] blocks: u32,
) {
    let config = LaunchConfig::for_elements(elements, block).unwrap();
    assert_eq!(config.grid, (blocks, 1, 1));
    assert_eq!(config.block, (block, 1, 1));
    assert_eq!(config.shared_mem_bytes, 0);
    let threads = u64::from(blocks) * u64::from(block);
    assert!(
        threads >= elements as u64,
        "{threads} threads for {elements} elements"
    );
}

#[rstest]
#[case::zero_block(3, 0)]
#[case::block_too_big(3, 2048)]
#[case::grid_too_big(LaunchConfig::MAX_GRID_X as usize + 1, 1)]
#[case::everything(usize::MAX, 1024)]
fn impossible_launch_shapes_are_typed_errors(#[case] elements: usize, #[case] block: u32) {
    assert!(matches!(
        LaunchConfig::for_elements(elements, block),
        Err(DriverError::InvalidArgument {
            operation: "LaunchConfig::for_elements",
            ..
        })
    ));
}

#[test]
fn kernel_args_count_what_was_pushed() {
    let (pointer, value, n) = (0u64, 7u32, 3usize);
    assert!(KernelArgs::new().is_empty());
    let args = KernelArgs::new().arg(&pointer).arg(&value).arg(&n);
    assert_eq!(args.len(), 3);
    assert!(!args.is_empty());
}
