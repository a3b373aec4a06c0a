//! Raw memory on a real GPU: bytes survive every copy path, memsets write exactly their range,
//! and bad requests fail with typed errors.
//!
//! Synchronous calls all go to the legacy default stream and asynchronous ones to one
//! non-blocking stream per test, never mixed: a non-blocking stream is not ordered after the
//! legacy stream, and a "synchronous" memset or device-to-device copy may return before the
//! device has done it.

use std::sync::Arc;

use cuweave_driver::memory::{
    self, DeviceAllocation, HostAllocFlags, HostAllocation, HostRegistration, ManagedAllocation,
    MemoryPool, MemoryType,
};
use cuweave_driver::{Context, DriverError, Stream, StreamFlags};
use cuweave_test_support::require_gpu;
use rstest::rstest;

const MIB: usize = 1 << 20;
/// What host buffers hold before a copy lands in them; no pattern byte run matches it for long.
const HOST_SENTINEL: u8 = 0xEE;
/// What a device buffer is set to before a copy is supposed to overwrite it.
const DEVICE_SENTINEL: u8 = 0x5A;

#[derive(Debug, Clone, Copy)]
enum HostKind {
    /// A `Vec`: the driver stages copies through its own pinned buffers.
    Pageable,
    /// `cuMemHostAlloc` memory.
    Pinned,
    /// A `Vec` page-locked in place with `cuMemHostRegister`.
    Registered,
}

#[derive(Debug, Clone, Copy)]
enum Mode {
    /// The synchronous calls, on the legacy default stream.
    Sync,
    /// The `_async` calls on one non-blocking stream, then a synchronize.
    Async,
}

/// Bytes that differ between neighbours and between seeds (Knuth's multiplicative hash).
fn pattern(bytes: usize, seed: u64) -> Vec<u8> {
    (0..bytes as u64)
        .map(|i| (i.wrapping_add(seed).wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect()
}

/// Compares without printing megabytes when they differ.
fn assert_same(actual: &[u8], expected: &[u8], what: &str) {
    assert_eq!(actual.len(), expected.len(), "{what}: length");
    if let Some(first) = actual.iter().zip(expected).position(|(a, e)| a != e) {
        let wrong = actual.iter().zip(expected).filter(|(a, e)| a != e).count();
        panic!(
            "{what}: {wrong} of {} bytes differ, first at {first}: {:#04x} instead of {:#04x}",
            actual.len(),
            actual[first],
            expected[first]
        );
    }
}

/// Host `src` -> device `a` -> device `b` -> host `dst`, with `b` first set to a sentinel so a
/// skipped device-to-device copy cannot pass by finding stale bytes of an earlier test there.
///
/// # Safety
/// `src` is readable and `dst` writable for `bytes`, and neither is touched until this returns.
unsafe fn through_two_device_buffers(
    context: &Arc<Context>,
    mode: Mode,
    src: *const u8,
    dst: *mut u8,
    bytes: usize,
) {
    let a = DeviceAllocation::new(context, bytes).unwrap();
    let b = DeviceAllocation::new(context, bytes).unwrap();
    assert_eq!((a.len(), b.len()), (bytes, bytes));
    match mode {
        // SAFETY: `a` and `b` hold `bytes` bytes each; the host ranges are the caller's; all four
        // calls are on the legacy stream, so each sees the one before.
        Mode::Sync => unsafe {
            memory::memset_d8(context, b.ptr(), DEVICE_SENTINEL, bytes).unwrap();
            memory::copy_htod(context, a.ptr(), src, bytes).unwrap();
            memory::copy_dtod(context, b.ptr(), a.ptr(), bytes).unwrap();
            memory::copy_dtoh(context, dst, b.ptr(), bytes).unwrap();
        },
        Mode::Async => {
            let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
            // SAFETY: as above, ordered on `stream`; everything outlives the synchronize.
            unsafe {
                memory::memset_d8_async(b.ptr(), DEVICE_SENTINEL, bytes, &stream).unwrap();
                memory::copy_htod_async(a.ptr(), src, bytes, &stream).unwrap();
                memory::copy_dtod_async(b.ptr(), a.ptr(), bytes, &stream).unwrap();
                memory::copy_dtoh_async(dst, b.ptr(), bytes, &stream).unwrap();
            }
            stream.synchronize().unwrap();
        }
    }
}

#[rstest]
fn bytes_round_trip_host_device_device_host(
    #[values(1, 4097, MIB + 3)] bytes: usize,
    #[values(HostKind::Pageable, HostKind::Pinned, HostKind::Registered)] host: HostKind,
    #[values(Mode::Sync, Mode::Async)] mode: Mode,
) {
    let gpu = require_gpu!();
    let context = &gpu.context;
    // A different pattern per case, so parallel cases cannot satisfy each other.
    let seed = bytes as u64 ^ ((host as u64) << 40) ^ ((mode as u64) << 48);
    let expected = pattern(bytes, seed);
    let mut arrived = vec![HOST_SENTINEL; bytes];
    match host {
        HostKind::Pageable => {
            let src = expected.clone();
            // SAFETY: `src` and `arrived` are `bytes` long and untouched until the call returns.
            unsafe {
                through_two_device_buffers(context, mode, src.as_ptr(), arrived.as_mut_ptr(), bytes)
            };
        }
        HostKind::Pinned => {
            let mut src = HostAllocation::new(context, bytes, HostAllocFlags::default()).unwrap();
            let mut dst = HostAllocation::new(context, bytes, HostAllocFlags::default()).unwrap();
            src.as_bytes_mut().copy_from_slice(&expected);
            dst.as_bytes_mut().fill(HOST_SENTINEL);
            // SAFETY: both pinned buffers are `bytes` long and untouched until the call returns.
            unsafe {
                through_two_device_buffers(context, mode, src.as_ptr(), dst.as_mut_ptr(), bytes)
            };
            arrived.copy_from_slice(dst.as_bytes());
        }
        HostKind::Registered => {
            let mut src_memory = expected.clone();
            let src = HostRegistration::new(context, &mut src_memory).unwrap();
            let mut dst = HostRegistration::new(context, &mut arrived).unwrap();
            assert_eq!((src.len(), dst.len()), (bytes, bytes));
            // SAFETY: both registered ranges are `bytes` long and untouched until the call returns.
            unsafe {
                through_two_device_buffers(context, mode, src.as_ptr(), dst.as_mut_ptr(), bytes)
            };
            // Dropping the registrations hands `arrived` back for reading.
        }
    }
    assert_same(
        &arrived,
        &expected,
        &format!("{bytes} bytes, {host:?}, {mode:?}"),
    );
}

#[rstest]
fn memsets_write_exactly_their_range(
    #[values(1, 4097, MIB + 3)] bytes: usize,
    #[values(Mode::Sync, Mode::Async)] mode: Mode,
) {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let buffer = DeviceAllocation::new(context, bytes).unwrap();
    let words = bytes / 4;
    let word: u32 = 0x0102_0304 ^ bytes as u32;
    // Byte fill, then whole words over it (an odd tail keeps the bytes), then two bytes at an
    // odd address inside the words.
    let mut expected = vec![0xABu8; bytes];
    for chunk in expected.chunks_exact_mut(4) {
        chunk.copy_from_slice(&word.to_ne_bytes());
    }
    let odd = bytes >= 4;
    if odd {
        expected[1..3].fill(0xCD);
    }
    let mut arrived = vec![HOST_SENTINEL; bytes];
    match mode {
        // SAFETY: every range lies inside `buffer` (words * 4 <= bytes, 1 + 2 <= bytes when
        // `odd`); all calls are on the legacy stream, so they apply in order and the copy sees them.
        Mode::Sync => unsafe {
            memory::memset_d8(context, buffer.ptr(), 0xAB, bytes).unwrap();
            if words > 0 {
                memory::memset_d32(context, buffer.ptr(), word, words).unwrap();
            }
            if odd {
                memory::memset_d8(context, buffer.ptr() + 1, 0xCD, 2).unwrap();
            }
            memory::copy_dtoh(context, arrived.as_mut_ptr(), buffer.ptr(), bytes).unwrap();
        },
        Mode::Async => {
            let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
            // SAFETY: as above, ordered on `stream`; `arrived` is read after the synchronize.
            unsafe {
                memory::memset_d8_async(buffer.ptr(), 0xAB, bytes, &stream).unwrap();
                if words > 0 {
                    memory::memset_d32_async(buffer.ptr(), word, words, &stream).unwrap();
                }
                if odd {
                    memory::memset_d8_async(buffer.ptr() + 1, 0xCD, 2, &stream).unwrap();
                }
                memory::copy_dtoh_async(arrived.as_mut_ptr(), buffer.ptr(), bytes, &stream)
                    .unwrap();
            }
            stream.synchronize().unwrap();
        }
    }
    assert_same(
        &arrived,
        &expected,
        &format!("memsets over {bytes} bytes, {mode:?}"),
    );
}

/// A 16-bit fill at a 2-byte (not 4-byte) aligned offset over an odd number of values, the
/// `f16` / `bf16` case `memset_d32` cannot do: exactly those bytes change, in the value's
/// native byte order, and the bytes just before and after keep the sentinel. An odd address is
/// refused with `InvalidArgument` before the driver is asked.
#[rstest]
fn a_16_bit_memset_fills_an_odd_count_at_a_2_byte_offset(
    #[values(Mode::Sync, Mode::Async)] mode: Mode,
) {
    let gpu = require_gpu!();
    let context = &gpu.context;
    const BYTES: usize = 64;
    const OFFSET: usize = 2;
    const COUNT: usize = 13;
    const VALUE: u16 = 0x3C01; // 1.0009765625 as f16: its two bytes differ
    let buffer = DeviceAllocation::new(context, BYTES).unwrap();
    let mut expected = vec![DEVICE_SENTINEL; BYTES];
    for half in expected[OFFSET..OFFSET + 2 * COUNT].chunks_exact_mut(2) {
        half.copy_from_slice(&VALUE.to_ne_bytes());
    }
    let mut arrived = vec![HOST_SENTINEL; BYTES];
    let dst = buffer.ptr() + OFFSET as u64;
    let misaligned = match mode {
        // SAFETY: `OFFSET + 2 * COUNT <= BYTES` and `dst` is 2-byte aligned (allocations are
        // 256-byte aligned); all calls are on the legacy stream, in order.
        Mode::Sync => unsafe {
            memory::memset_d8(context, buffer.ptr(), DEVICE_SENTINEL, BYTES).unwrap();
            memory::memset_d16(context, dst, VALUE, COUNT).unwrap();
            memory::copy_dtoh(context, arrived.as_mut_ptr(), buffer.ptr(), BYTES).unwrap();
            memory::memset_d16(context, dst + 1, VALUE, COUNT).unwrap_err()
        },
        Mode::Async => {
            let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
            // SAFETY: as above, ordered on `stream`; `arrived` is read after the synchronize.
            let misaligned = unsafe {
                memory::memset_d8_async(buffer.ptr(), DEVICE_SENTINEL, BYTES, &stream).unwrap();
                memory::memset_d16_async(dst, VALUE, COUNT, &stream).unwrap();
                memory::copy_dtoh_async(arrived.as_mut_ptr(), buffer.ptr(), BYTES, &stream)
                    .unwrap();
                memory::memset_d16_async(dst + 1, VALUE, COUNT, &stream).unwrap_err()
            };
            stream.synchronize().unwrap();
            misaligned
        }
    };
    assert_same(
        &arrived,
        &expected,
        &format!("{COUNT} u16s at offset {OFFSET}, {mode:?}"),
    );
    assert_eq!(arrived[OFFSET - 1], DEVICE_SENTINEL, "the byte before");
    assert_eq!(
        arrived[OFFSET + 2 * COUNT],
        DEVICE_SENTINEL,
        "the byte after"
    );
    assert!(
        matches!(misaligned, DriverError::InvalidArgument { .. }),
        "{misaligned:?}"
    );
}

#[test]
fn an_allocation_larger_than_the_device_is_out_of_memory() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let total = gpu.device.total_memory().unwrap();
    let error = DeviceAllocation::new(context, total * 2).unwrap_err();
    assert!(error.is_out_of_memory(), "{error:?}");
    match &error {
        DriverError::Cuda { operation, .. } => {
            assert_eq!(error.name().unwrap(), "CUDA_ERROR_OUT_OF_MEMORY");
            assert_eq!(*operation, "cuMemAlloc_v2");
        }
        other => panic!("{other:?}"),
    }
    // The failure is not sticky: the context still allocates.
    let small = DeviceAllocation::new(context, MIB).unwrap();
    assert_eq!(small.len(), MIB);
}

fn zero_device(context: &Arc<Context>, _: &Stream) -> Result<(), DriverError> {
    DeviceAllocation::new(context, 0).map(drop)
}

fn zero_pinned(context: &Arc<Context>, _: &Stream) -> Result<(), DriverError> {
    HostAllocation::new(context, 0, HostAllocFlags::default()).map(drop)
}

fn zero_managed(context: &Arc<Context>, _: &Stream) -> Result<(), DriverError> {
    ManagedAllocation::new(context, 0).map(drop)
}

fn zero_registration(context: &Arc<Context>, _: &Stream) -> Result<(), DriverError> {
    HostRegistration::new(context, &mut []).map(drop)
}

fn zero_stream_ordered(_: &Arc<Context>, stream: &Stream) -> Result<(), DriverError> {
    // SAFETY: a zero-byte request is refused before the driver is called, so nothing is
    // allocated that would need freeing.
    unsafe { memory::alloc_async(stream, 0) }.map(drop)
}

fn zero_from_pool(context: &Arc<Context>, stream: &Stream) -> Result<(), DriverError> {
    let pool = MemoryPool::device_default(context)?;
    // SAFETY: as `zero_stream_ordered`.
    unsafe { pool.alloc_async(0, stream) }.map(drop)
}

type ZeroRequest = fn(&Arc<Context>, &Stream) -> Result<(), DriverError>;

#[rstest]
#[case::device(zero_device, "DeviceAllocation::new")]
#[case::pinned(zero_pinned, "HostAllocation::new")]
#[case::managed(zero_managed, "ManagedAllocation::new")]
#[case::registration(zero_registration, "HostRegistration::new")]
#[case::stream_ordered(zero_stream_ordered, "alloc_async")]
#[case::pool(zero_from_pool, "MemoryPool::alloc_async")]
fn zero_byte_requests_are_invalid_arguments(
    #[case] request: ZeroRequest,
    #[case] expected_operation: &str,
) {
    let gpu = require_gpu!();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    match request(&gpu.context, &stream) {
        Err(DriverError::InvalidArgument { operation, reason }) => {
            assert_eq!(operation, expected_operation);
            assert!(reason.contains("zero"), "{reason}");
        }
        other => panic!("{expected_operation} with zero bytes gave {other:?}"),
    }
}

#[test]
fn pointer_attributes_tell_device_from_pinned_memory() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let device = DeviceAllocation::new(context, MIB).unwrap();
    let attributes = memory::pointer_attributes(device.ptr()).unwrap();
    assert_eq!(attributes.memory_type, MemoryType::Device);
    assert_eq!(attributes.device_ordinal, 0);
    assert!(!attributes.is_managed);
    // An address inside the allocation belongs to it too.
    let inside = memory::pointer_attributes(device.ptr() + MIB as u64 / 2).unwrap();
    assert_eq!(inside.memory_type, MemoryType::Device);

    let pinned = HostAllocation::new(context, MIB, HostAllocFlags::default()).unwrap();
    let attributes = memory::pointer_attributes(pinned.as_ptr() as u64).unwrap();
    assert_eq!(attributes.memory_type, MemoryType::Host);
    assert!(!attributes.is_managed);
}

#[test]
fn mapped_pinned_memory_is_written_by_the_device_in_place() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    const WORDS: usize = 4096;
    let mut mapped =
        HostAllocation::new(context, WORDS * 4, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    assert_eq!(mapped.flags(), HostAllocFlags::PORTABLE_MAPPED);
    mapped.as_bytes_mut().fill(0);
    let device_view = mapped.device_ptr().unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    // SAFETY: `device_view` maps the WORDS live u32s of `mapped`, which the host does not touch
    // until the synchronize.
    unsafe { memory::memset_d32_async(device_view, 0x1234_5678, WORDS, &stream).unwrap() };
    stream.synchronize().unwrap();
    assert!(
        mapped
            .as_bytes()
            .chunks_exact(4)
            .all(|word| word == 0x1234_5678u32.to_ne_bytes())
    );

    let unmapped = HostAllocation::new(context, 4, HostAllocFlags::default()).unwrap();
    match unmapped.device_ptr() {
        Err(DriverError::InvalidArgument { operation, .. }) => {
            assert_eq!(operation, "HostAllocation::device_ptr");
        }
        other => panic!("device pointer of unmapped memory gave {other:?}"),
    }
}
