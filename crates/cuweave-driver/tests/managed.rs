//! Managed memory on a real GPU: advice and prefetch read back through the driver's own range
//! attributes, and data written by the host, changed by a kernel and prefetched back arrives.
//!
//! Allocations stay at 16 MiB: far below any device's memory, so managed memory is never
//! oversubscribed even with every test of this file running at once.

use std::sync::Arc;

use cuweave_driver::memory::{
    self, Advice, ManagedAllocation, MemLocation, PrefetchRange, advise, prefetch_async,
    prefetch_batch_async, range_accessed_by, range_last_prefetch_location,
    range_preferred_location, range_read_mostly,
};
use cuweave_driver::{Context, DriverError, Stream, StreamFlags, driver};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;
use rstest::rstest;

const BYTES: usize = 16 << 20;
const HERE: MemLocation = MemLocation::Device(0);

fn managed(context: &Arc<Context>) -> ManagedAllocation {
    let allocation = ManagedAllocation::new(context, BYTES).unwrap();
    assert_eq!(allocation.len(), BYTES);
    allocation
}

/// Advice on the whole allocation.
fn advise_all(allocation: &ManagedAllocation, advice: Advice, location: MemLocation) {
    // SAFETY: the range is exactly one live managed allocation.
    unsafe {
        advise(
            allocation.context(),
            allocation.ptr(),
            BYTES,
            advice,
            location,
        )
    }
    .unwrap();
}

/// Queues a prefetch of `[offset, offset + bytes)` of the allocation.
fn prefetch(
    allocation: &ManagedAllocation,
    offset: usize,
    bytes: usize,
    to: MemLocation,
    stream: &Stream,
) -> Result<(), DriverError> {
    assert!(offset + bytes <= allocation.len());
    // SAFETY: the range lies inside one live managed allocation, which every caller keeps until
    // it has synchronized `stream`.
    unsafe { prefetch_async(allocation.ptr() + offset as u64, bytes, to, stream) }
}

fn last_prefetch(
    allocation: &ManagedAllocation,
    offset: usize,
    bytes: usize,
) -> Option<MemLocation> {
    range_last_prefetch_location(
        allocation.context(),
        allocation.ptr() + offset as u64,
        bytes,
    )
    .unwrap()
}

/// Whether prefetch can work here; where it cannot, proves that it says so with a typed error.
fn prefetch_supported(context: &Arc<Context>, allocation: &ManagedAllocation) -> bool {
    if context
        .device()
        .supports_concurrent_managed_access()
        .unwrap()
    {
        return true;
    }
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let refused = prefetch(allocation, 0, BYTES, HERE, &stream);
    assert!(
        matches!(
            refused,
            Err(DriverError::CapabilityMissing {
                capability: "concurrent managed access",
                ..
            })
        ),
        "{refused:?}"
    );
    eprintln!("no concurrent managed access: prefetch is refused as it should be");
    false
}

#[test]
fn a_managed_pointer_is_reported_as_managed() {
    let gpu = require_gpu!();
    let allocation = managed(&gpu.context);
    let attributes = memory::pointer_attributes(allocation.ptr()).unwrap();
    eprintln!("managed memory reports {attributes:?}");
    assert!(attributes.is_managed);
    assert_eq!(attributes.device_ordinal, 0);
}

#[test]
fn a_fresh_range_carries_no_advice() {
    let gpu = require_gpu!();
    let allocation = managed(&gpu.context);
    let (context, ptr) = (&gpu.context, allocation.ptr());
    assert!(!range_read_mostly(context, ptr, BYTES).unwrap());
    assert_eq!(range_preferred_location(context, ptr, BYTES).unwrap(), None);
    assert_eq!(range_accessed_by(context, ptr, BYTES).unwrap(), []);
    assert_eq!(last_prefetch(&allocation, 0, BYTES), None);
}

#[test]
fn read_mostly_advice_reads_back_and_can_be_undone() {
    let gpu = require_gpu!();
    let allocation = managed(&gpu.context);
    let (context, ptr) = (&gpu.context, allocation.ptr());
    advise_all(&allocation, Advice::SetReadMostly, HERE);
    assert!(range_read_mostly(context, ptr, BYTES).unwrap());
    // A sub-range of an advised range is advised too.
    assert!(range_read_mostly(context, ptr + 4096, 4096).unwrap());
    advise_all(&allocation, Advice::UnsetReadMostly, HERE);
    assert!(!range_read_mostly(context, ptr, BYTES).unwrap());
}

#[rstest]
#[case::device(HERE)]
#[case::host(MemLocation::Host)]
fn preferred_location_reads_back_and_can_be_undone(#[case] location: MemLocation) {
    let gpu = require_gpu!();
    let allocation = managed(&gpu.context);
    let (context, ptr) = (&gpu.context, allocation.ptr());
    advise_all(&allocation, Advice::SetPreferredLocation, location);
    assert_eq!(
        range_preferred_location(context, ptr, BYTES).unwrap(),
        Some(location)
    );
    advise_all(&allocation, Advice::UnsetPreferredLocation, location);
    assert_eq!(range_preferred_location(context, ptr, BYTES).unwrap(), None);
}

#[test]
fn accessed_by_advice_reads_back_and_can_be_undone() {
    let gpu = require_gpu!();
    let allocation = managed(&gpu.context);
    let (context, ptr) = (&gpu.context, allocation.ptr());
    advise_all(&allocation, Advice::SetAccessedBy, HERE);
    assert!(
        range_accessed_by(context, ptr, BYTES)
            .unwrap()
            .contains(&HERE)
    );
    advise_all(&allocation, Advice::UnsetAccessedBy, HERE);
    assert!(
        !range_accessed_by(context, ptr, BYTES)
            .unwrap()
            .contains(&HERE)
    );
}

#[test]
fn prefetched_data_is_where_the_kernel_and_the_host_use_it() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocation = managed(context);
    if !prefetch_supported(context, &allocation) {
        return;
    }
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let words = BYTES / 4;
    let host_view = || {
        // SAFETY: the allocation holds `words` u32s, is host-accessible (managed), and no device
        // work touches it while this borrow lives: every use below follows a synchronize.
        unsafe { std::slice::from_raw_parts_mut(allocation.ptr() as *mut u32, words) }
    };
    for (i, word) in host_view().iter_mut().enumerate() {
        *word = (i as u32).wrapping_mul(2_654_435_761);
    }

    prefetch(&allocation, 0, BYTES, HERE, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(last_prefetch(&allocation, 0, BYTES), Some(HERE));

    // SAFETY: the kernel touches the allocation's `words` u32s; the host does not until the
    // synchronize below.
    unsafe { kernels.increment_u32(&stream, allocation.ptr(), words) }.unwrap();
    prefetch(&allocation, 0, BYTES, MemLocation::Host, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(
        last_prefetch(&allocation, 0, BYTES),
        Some(MemLocation::Host)
    );

    let wrong = host_view()
        .iter()
        .enumerate()
        .filter(|&(i, &word)| word != (i as u32).wrapping_mul(2_654_435_761).wrapping_add(1))
        .count();
    assert_eq!(wrong, 0, "{wrong} words did not come back incremented");
}

#[test]
fn prefetch_to_two_places_reports_each_half() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocation = managed(context);
    if !prefetch_supported(context, &allocation) {
        return;
    }
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let half = BYTES / 2;
    prefetch(&allocation, 0, half, HERE, &stream).unwrap();
    prefetch(&allocation, half, half, MemLocation::Host, &stream).unwrap();
    stream.synchronize().unwrap();
    assert_eq!(last_prefetch(&allocation, 0, half), Some(HERE));
    assert_eq!(
        last_prefetch(&allocation, half, half),
        Some(MemLocation::Host)
    );
    // The whole range went to two places, which the driver reports as no single location.
    assert_eq!(last_prefetch(&allocation, 0, BYTES), None);
}

#[test]
fn batched_prefetch_moves_every_range_or_is_unsupported() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocation = managed(context);
    if !prefetch_supported(context, &allocation) {
        return;
    }
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let quarter = BYTES / 4;
    let range = |index: usize, location| PrefetchRange {
        ptr: allocation.ptr() + (index * quarter) as u64,
        bytes: quarter,
        location,
    };
    // Two runs of equal targets, so the call gets two location entries for four ranges.
    let ranges = [
        range(0, HERE),
        range(1, HERE),
        range(2, MemLocation::Host),
        range(3, MemLocation::Host),
    ];
    // SAFETY: every range lies inside the live allocation, kept until the synchronize.
    let outcome = unsafe { prefetch_batch_async(&ranges, &stream) };
    if !driver().unwrap().mem_prefetch_batch_async.is_available() {
        assert_eq!(
            outcome,
            Err(DriverError::Unsupported {
                symbol: "cuMemPrefetchBatchAsync"
            })
        );
        eprintln!("driver has no cuMemPrefetchBatchAsync (CUDA 13.0+): Unsupported, as it should");
        return;
    }
    outcome.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(last_prefetch(&allocation, 0, 2 * quarter), Some(HERE));
    assert_eq!(
        last_prefetch(&allocation, 2 * quarter, 2 * quarter),
        Some(MemLocation::Host)
    );

    // One target for everything.
    let all_here = ranges.map(|r| PrefetchRange {
        location: HERE,
        ..r
    });
    // SAFETY: as above.
    unsafe { prefetch_batch_async(&all_here, &stream) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(last_prefetch(&allocation, 0, BYTES), Some(HERE));
}

#[test]
fn empty_ranges_are_refused_before_the_driver_sees_them() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let allocation = managed(context);
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let ptr = allocation.ptr();
    let invalid = |result: Result<(), DriverError>, expected: &str| match result {
        Err(DriverError::InvalidArgument { operation, .. }) => assert_eq!(operation, expected),
        other => panic!("{expected}: {other:?}"),
    };
    // SAFETY: zero-length and empty requests are refused before anything reaches the driver.
    unsafe {
        invalid(
            advise(context, ptr, 0, Advice::SetReadMostly, HERE),
            "advise",
        );
        invalid(prefetch_async(ptr, 0, HERE, &stream), "prefetch_async");
        invalid(prefetch_batch_async(&[], &stream), "prefetch_batch_async");
        let zero = PrefetchRange {
            ptr,
            bytes: 0,
            location: HERE,
        };
        invalid(
            prefetch_batch_async(&[zero], &stream),
            "prefetch_batch_async",
        );
    }
    invalid(
        range_read_mostly(context, ptr, 0).map(drop),
        "range_attribute",
    );
    invalid(
        range_accessed_by(context, ptr, 0).map(drop),
        "range_accessed_by",
    );
}
