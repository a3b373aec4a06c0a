//! PyTorch's allocator settings on a real GPU: `max_split_size_mb` keeps a freed large block
//! whole for large requests, and `set_per_process_memory_fraction` caps what the allocator
//! reserves, with the out-of-memory error naming the cap and the cache given back first.

use std::sync::Arc;

use cuweave_driver::{Stream, StreamFlags};
use cuweave_memory::caching::{AllocatorConfig, CachingAllocator};
use cuweave_memory::resource::DriverResource;
use cuweave_memory::{Buffer, MemoryError};
use cuweave_test_support::require_gpu;

const MIB: usize = 1 << 20;

/// A training step frees a 200 MiB activation and the next step asks for 30 MiB pieces: with
/// `max_split_size_mb:64` they do not carve the 200 MiB block (which stays whole for the next
/// 190 MiB request, reused exactly); without it the first piece splits it. The bytes of every
/// buffer round-trip, so the blocks are real and disjoint.
#[test]
fn max_split_size_keeps_a_freed_large_block_for_large_requests() {
    let gpu = require_gpu!();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let config = AllocatorConfig::default().with_max_split_size(64 * MIB);
    let limited =
        CachingAllocator::with_config(Arc::new(DriverResource::new(&gpu.context)), config).unwrap();
    let plain = CachingAllocator::with_driver(&gpu.context);
    for (allocator, splits) in [(&limited, false), (&plain, true)] {
        let big = allocator.buffer::<u8>(200 * MIB, &stream).unwrap();
        let big_ptr = big.device_ptr();
        drop(big);
        let mut piece = allocator.buffer::<u32>(30 * MIB / 4, &stream).unwrap();
        assert_eq!(
            piece.device_ptr() == big_ptr,
            splits,
            "a 30 MiB request split the freed 200 MiB block: {splits} expected"
        );
        let data: Vec<u32> = (0..piece.len() as u32).collect();
        piece.copy_from_host(&data).unwrap();
        let mut back = vec![0u32; data.len()];
        piece.copy_to_host(&mut back).unwrap();
        assert_eq!(back, data);
        if !splits {
            let near = allocator.buffer::<u8>(190 * MIB, &stream).unwrap();
            assert_eq!(
                near.device_ptr(),
                big_ptr,
                "within 20 MiB it is reused whole"
            );
            assert_eq!(allocator.stats().segments.current, 2);
        }
        drop(piece);
        stream.synchronize().unwrap();
        allocator.empty_cache().unwrap();
        assert_eq!(allocator.stats().reserved_bytes.current, 0);
    }
}

/// `set_per_process_memory_fraction`: with a fraction worth about 256 MiB of this device, a
/// 160 MiB buffer fits, a second one does not (typed out-of-memory naming the cap) even after
/// the cache was released, and once the first is dropped the second fits.
#[test]
fn memory_fraction_caps_what_the_allocator_reserves() {
    let gpu = require_gpu!();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let total = gpu.device.total_memory().unwrap();
    let fraction = (256 * MIB) as f64 / total as f64;
    let cap = (total as f64 * fraction) as usize;
    let config = AllocatorConfig::default().with_memory_fraction(fraction);
    let allocator =
        CachingAllocator::with_config(Arc::new(DriverResource::new(&gpu.context)), config).unwrap();
    let first = allocator.buffer::<u8>(160 * MIB, &stream).unwrap();
    match allocator.buffer::<u8>(160 * MIB, &stream) {
        Err(MemoryError::OutOfMemory { limit, .. }) => assert_eq!(limit, Some(cap)),
        other => panic!("past the fraction: {other:?}"),
    }
    assert_eq!(allocator.stats().ooms, 1);
    drop(first);
    let second = allocator.buffer::<u8>(160 * MIB, &stream).unwrap();
    assert!(allocator.stats().reserved_bytes.current <= cap);
    drop(second);
    stream.synchronize().unwrap();
    allocator.empty_cache().unwrap();
}

/// A setting out of range is refused before any memory is touched.
#[test]
fn out_of_range_settings_are_refused() {
    let gpu = require_gpu!();
    for config in [
        AllocatorConfig::default().with_memory_fraction(0.0),
        AllocatorConfig::default().with_memory_fraction(2.0),
        AllocatorConfig::default().with_max_split_size(MIB),
    ] {
        let result =
            CachingAllocator::with_config(Arc::new(DriverResource::new(&gpu.context)), config);
        assert!(
            matches!(result, Err(MemoryError::InvalidConfig { .. })),
            "{config:?}: {:?}",
            result.err()
        );
    }
}
