//! GPU tests of the typed buffers: bytes round-trip through every kind of buffer, blocking and
//! asynchronous, ranged and whole; fills of many element types; async copies own their host
//! side; uses on different streams are ordered; bad requests are typed errors.

use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytemuck::{Pod, Zeroable};
use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::MemoryError;
use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer, UnifiedBuffer};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

/// A 12-byte plain-data struct whose bytes repeat with no period shorter than itself.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Pod, Zeroable)]
struct Sample {
    a: u32,
    b: f32,
    c: u16,
    d: u16,
}

const MS: u64 = 1_000_000;

/// Serializes this file's GPU tests. Several assert that host access is refused while a spin
/// kernel runs; a driver call in a concurrent test (a free or a pinning, which wait for the whole
/// device and hold driver locks meanwhile) could block this thread until the spin has ended.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

fn pattern(len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect()
}

/// Every buffer kind, made from `data`, reads back `data` and takes a second upload.
fn round_trip<B: Buffer<u32>>(make: impl Fn(&[u32]) -> cuweave_memory::Result<B>) {
    let data = pattern(100_003);
    let mut buffer = make(&data).expect("buffer");
    assert_eq!(buffer.len(), data.len());
    assert_eq!(buffer.byte_size(), data.len() * 4);
    assert_eq!(buffer.to_vec().unwrap(), data);
    let second: Vec<u32> = data.iter().map(|x| !x).collect();
    buffer.copy_from_host(&second).unwrap();
    let mut back = vec![0u32; data.len()];
    buffer.copy_to_host(&mut back).unwrap();
    assert_eq!(back, second);
}

#[test]
fn every_buffer_kind_round_trips_bytes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    round_trip(|data| DeviceBuffer::from_slice(ctx, data));
    round_trip(|data| PinnedBuffer::from_slice(ctx, data));
    round_trip(|data| UnifiedBuffer::from_slice(ctx, data));
}

fn check_ranges<B: Buffer<u32>>(mut buffer: B) {
    let len = buffer.len();
    buffer.fill(0).unwrap();
    buffer.copy_range_from_host(10, &[1, 2, 3, 4, 5]).unwrap();
    buffer.copy_range_from_host(len - 2, &[8, 9]).unwrap();
    let all = buffer.to_vec().unwrap();
    let mut expected = vec![0u32; len];
    expected[10..15].copy_from_slice(&[1, 2, 3, 4, 5]);
    expected[len - 2..].copy_from_slice(&[8, 9]);
    assert_eq!(all, expected);
    let mut part = [0u32; 4];
    buffer.copy_range_to_host(11, &mut part).unwrap();
    assert_eq!(part, [2, 3, 4, 5]);
}

#[test]
fn ranged_copies_touch_only_their_range() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    check_ranges(DeviceBuffer::<u32>::new(ctx, 4099).unwrap());
    check_ranges(PinnedBuffer::<u32>::new(ctx, 4099).unwrap());
    check_ranges(UnifiedBuffer::<u32>::new(ctx, 4099).unwrap());
}

/// Fills a buffer of each kind with `value`, blocking and on a stream, and reads it back.
fn check_fill<T: cuweave_memory::Element + PartialEq + Debug>(
    ctx: &Arc<Context>,
    value: T,
    other: T,
    len: usize,
) {
    let s = stream(ctx);
    let mut device = DeviceBuffer::<T>::new(ctx, len).unwrap();
    let mut pinned = PinnedBuffer::<T>::new(ctx, len).unwrap();
    let mut unified = UnifiedBuffer::<T>::new(ctx, len).unwrap();
    device.fill(value).unwrap();
    pinned.fill(value).unwrap();
    unified.fill(value).unwrap();
    for (kind, got) in [
        ("device", device.to_vec().unwrap()),
        ("pinned", pinned.to_vec().unwrap()),
        ("unified", unified.as_slice().unwrap().to_vec()),
    ] {
        assert!(got.iter().all(|x| *x == value), "{kind} fill of {value:?}");
    }
    device.fill_async(other, &s).unwrap();
    pinned.fill_async(other, &s).unwrap();
    unified.fill_async(other, &s).unwrap();
    let pending = device.copy_to_host_async(vec![value; len], &s).unwrap();
    assert!(pending.wait().unwrap().iter().all(|x| *x == other));
    assert!(pinned.as_slice().unwrap().iter().all(|x| *x == other));
    assert!(unified.as_slice().unwrap().iter().all(|x| *x == other));
}

#[test]
fn fill_sets_every_element_of_any_plain_type() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    check_fill::<u8>(ctx, 0xab, 0, 100_001);
    check_fill::<u16>(ctx, 0x1234, 0x5678, 100_001); // odd count: not a whole number of words
    check_fill::<u32>(ctx, 0xdead_beef, 7, 100_000);
    check_fill::<f32>(ctx, 1.5, -0.25, 100_000);
    check_fill::<u64>(ctx, 0x0102_0304_0506_0708, u64::MAX, 100_003); // pattern path
    check_fill::<[u8; 3]>(ctx, [1, 2, 3], [9, 9, 9], 70_001); // odd size, pattern path
    let sample = Sample {
        a: 7,
        b: 2.5,
        c: 3,
        d: 4,
    };
    let other = Sample {
        a: u32::MAX,
        b: -1.0,
        c: 0,
        d: 65_535,
    };
    check_fill::<Sample>(ctx, sample, other, 50_001);
    check_fill::<Sample>(ctx, sample, other, 1);
}

#[test]
fn device_to_device_copies_between_every_kind() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let data = pattern(65_536);
    let source = DeviceBuffer::from_slice(ctx, &data).unwrap();
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, data.len()).unwrap();
    let mut pinned = PinnedBuffer::<u32>::new(ctx, data.len()).unwrap();
    let mut unified = UnifiedBuffer::<u32>::new(ctx, data.len()).unwrap();
    device.copy_from(&source).unwrap();
    pinned.copy_from(&device).unwrap();
    unified.copy_from_async(&pinned, &s).unwrap();
    assert_eq!(device.to_vec().unwrap(), data);
    assert_eq!(pinned.as_slice().unwrap(), &data[..]);
    assert_eq!(unified.as_slice().unwrap(), &data[..]);

    let mut target = DeviceBuffer::<u32>::zeroed(ctx, 100).unwrap();
    target.copy_range_from(10, &source, 1000, 20).unwrap();
    target
        .copy_range_from_async(50, &unified, 0, 5, &s)
        .unwrap();
    let got = target.to_vec().unwrap();
    assert_eq!(&got[10..30], &data[1000..1020]);
    assert_eq!(&got[50..55], &data[..5]);
    assert!(
        got[..10]
            .iter()
            .chain(&got[30..50])
            .chain(&got[55..])
            .all(|&x| x == 0)
    );
}

#[test]
fn async_copies_hand_back_their_host_side_with_the_data() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let data = pattern(1 << 20);
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, data.len()).unwrap();

    // Pinned source, owned: truly asynchronous; comes back unchanged.
    let pinned = PinnedBuffer::from_slice(ctx, &data).unwrap();
    let pinned = device
        .copy_from_host_async(pinned, &s)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(pinned.as_slice().unwrap(), &data[..]);
    assert_eq!(device.to_vec().unwrap(), data);

    // Pageable sources: a Vec and a boxed slice.
    let reversed: Vec<u32> = data.iter().rev().copied().collect();
    let back = device
        .copy_from_host_async(reversed.clone(), &s)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(back, reversed);
    assert_eq!(device.to_vec().unwrap(), reversed);
    let boxed: Box<[u32]> = data.clone().into_boxed_slice();
    device
        .copy_from_host_async(boxed, &s)
        .unwrap()
        .wait()
        .unwrap();

    // Sinks: a Vec, a boxed slice, an owned and a borrowed pinned buffer.
    let pending = device
        .copy_to_host_async(vec![0u32; data.len()], &s)
        .unwrap();
    assert_eq!(pending.bytes(), data.len() * 4);
    assert_eq!(pending.wait().unwrap(), data);
    let boxed = device
        .copy_to_host_async(vec![0u32; data.len()].into_boxed_slice(), &s)
        .unwrap();
    assert_eq!(&boxed.wait().unwrap()[..], &data[..]);
    let sink = PinnedBuffer::<u32>::new(ctx, data.len()).unwrap();
    let sink = device.copy_to_host_async(sink, &s).unwrap().wait().unwrap();
    assert_eq!(sink.as_slice().unwrap(), &data[..]);
    let mut borrowed = PinnedBuffer::<u32>::new(ctx, 1000).unwrap();
    device
        .copy_range_to_host_async(500, &mut borrowed, &s)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(borrowed.as_slice().unwrap(), &data[500..1500]);

    // Ranged upload from a borrowed pinned buffer.
    let patch = PinnedBuffer::from_slice(ctx, &[1u32, 2, 3]).unwrap();
    device
        .copy_range_from_host_async(7, &patch, &s)
        .unwrap()
        .wait()
        .unwrap();
    let mut part = [0u32; 5];
    device.copy_range_to_host(6, &mut part).unwrap();
    assert_eq!(part, [data[6], 1, 2, 3, data[10]]);
}

#[test]
fn dropping_a_pending_copy_waits_and_forgetting_one_is_safe() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(ctx);
    let data = pattern(4096);
    let device = DeviceBuffer::from_slice(ctx, &data).unwrap();

    // Dropped: returns only after the copy (behind a 20 ms spin) has finished.
    kernels.spin_ns(&s, 20 * MS).unwrap();
    let pending = device
        .copy_to_host_async(vec![0u32; data.len()], &s)
        .unwrap();
    drop(pending);
    assert!(
        device.is_idle().unwrap(),
        "drop returned before the copy finished"
    );

    // Forgotten: the borrowed pinned sink's own tracker still knows about the copy.
    let mut sink = PinnedBuffer::<u32>::new(ctx, data.len()).unwrap();
    kernels.spin_ns(&s, 50 * MS).unwrap();
    std::mem::forget(device.copy_to_host_async(&mut sink, &s).unwrap());
    assert!(matches!(
        sink.try_as_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    assert_eq!(sink.as_slice().unwrap(), &data[..]);
    assert!(sink.try_as_mut_slice().is_ok());
}

#[test]
fn a_blocking_upload_on_a_stream_lands_after_the_uses_it_conflicts_with() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (a, b) = (stream(ctx), stream(ctx));
    let len = 1 << 20;
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, len).unwrap();
    device.fill(5).unwrap();

    // A read on A behind a 20 ms spin; the upload on B must neither overtake it nor return
    // before it has itself landed.
    kernels.spin_ns(&a, 20 * MS).unwrap();
    let read = device
        .copy_to_host_async(PinnedBuffer::<u32>::new(ctx, len).unwrap(), &a)
        .unwrap();
    let data = pattern(4097);
    let back = device.copy_range_from_host_on(3, data.clone(), &b).unwrap();
    assert_eq!(back, data, "the host side comes back unchanged");
    assert!(
        read.is_complete().unwrap(),
        "the upload returned before the read it had to wait for finished"
    );
    assert!(
        read.wait()
            .unwrap()
            .as_slice()
            .unwrap()
            .iter()
            .all(|&x| x == 5),
        "the upload overtook the earlier read"
    );
    let now = device.to_vec().unwrap();
    assert!(now[..3].iter().all(|&x| x == 5));
    assert_eq!(&now[3..3 + data.len()], &data[..]);
    assert!(now[3 + data.len()..].iter().all(|&x| x == 5));

    // The same through a completion word, behind a read on A again.
    let words = cuweave_driver::memory::CompletionWords::new(ctx).unwrap();
    kernels.spin_ns(&a, 20 * MS).unwrap();
    let read = device
        .copy_to_host_async(PinnedBuffer::<u32>::new(ctx, len).unwrap(), &a)
        .unwrap();
    let reversed: Vec<u32> = data.iter().rev().copied().collect();
    let back = device
        .copy_range_from_host_watched(3, reversed.clone(), &b, &words)
        .unwrap();
    assert_eq!(back, reversed);
    assert!(
        read.is_complete().unwrap(),
        "the watched upload returned early"
    );
    let before = read.wait().unwrap();
    assert_eq!(&before.as_slice().unwrap()[3..3 + data.len()], &data[..]);
    assert_eq!(&device.to_vec().unwrap()[3..3 + data.len()], &reversed[..]);

    // A pinned source (with a tracker of its own) and a bad range.
    let pinned = PinnedBuffer::from_slice(ctx, &[9u32; 16]).unwrap();
    let pinned = device
        .copy_range_from_host_on(len - 16, pinned, &b)
        .unwrap();
    assert_eq!(pinned.as_slice().unwrap(), &[9u32; 16]);
    assert_eq!(device.to_vec().unwrap()[len - 16..], [9u32; 16]);
    let refused = device
        .copy_range_from_host_on(len - 1, vec![1u32; 2], &b)
        .expect_err("a range past the end was copied");
    assert!(matches!(refused.error(), MemoryError::OutOfRange { .. }));
    assert_eq!(
        refused.into_host(),
        Some(vec![1u32; 2]),
        "the Vec handed back"
    );
}

#[test]
fn a_use_on_another_stream_waits_for_the_previous_use() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (a, b) = (stream(ctx), stream(ctx));
    let len = 1 << 20;
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, len).unwrap();

    // Read after write: the write on A runs after a 20 ms spin; B must wait for it.
    let fresh = PinnedBuffer::from_slice(ctx, &vec![42u32; len]).unwrap();
    kernels.spin_ns(&a, 20 * MS).unwrap();
    let upload = device.copy_from_host_async(fresh, &a).unwrap();
    let read = device
        .copy_to_host_async(PinnedBuffer::<u32>::new(ctx, len).unwrap(), &b)
        .unwrap();
    assert!(
        read.wait()
            .unwrap()
            .as_slice()
            .unwrap()
            .iter()
            .all(|&x| x == 42)
    );
    upload.wait().unwrap();

    // Write after read: the read on A runs after a spin; the fill on B must not overtake it.
    kernels.spin_ns(&a, 20 * MS).unwrap();
    let read = device
        .copy_to_host_async(PinnedBuffer::<u32>::new(ctx, len).unwrap(), &a)
        .unwrap();
    device.fill_async(7, &b).unwrap();
    assert!(
        read.wait()
            .unwrap()
            .as_slice()
            .unwrap()
            .iter()
            .all(|&x| x == 42)
    );
    assert_eq!(device.last_use(), Some(b.as_raw() as usize));
    assert!(device.to_vec().unwrap().iter().all(|&x| x == 7));
}

#[test]
fn kernels_join_the_order_through_prepare_and_record_use() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (a, b) = (stream(ctx), stream(ctx));
    let len = 1 << 20;
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, len).unwrap();
    kernels.spin_ns(&a, 20 * MS).unwrap();
    device.fill_async(1, &a).unwrap();
    device.prepare_use(&b).unwrap();
    // SAFETY: the buffer holds `len` u32s and outlives the kernel (its drop waits for the use
    // recorded below); nothing on the host touches it meanwhile.
    unsafe { kernels.increment_u32(&b, device.device_ptr(), len) }.unwrap();
    device.record_use(&b).unwrap();
    assert!(device.to_vec().unwrap().iter().all(|&x| x == 2));
}

#[test]
fn bad_requests_are_typed_errors() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let s = stream(ctx);
    assert!(matches!(
        DeviceBuffer::<u32>::new(ctx, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        PinnedBuffer::<u32>::new(ctx, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        UnifiedBuffer::<u32>::new(ctx, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<u32>::from_slice(ctx, &[]),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<u64>::new(ctx, usize::MAX / 4),
        Err(MemoryError::Misaligned { .. })
    ));

    let mut device = DeviceBuffer::<u32>::zeroed(ctx, 16).unwrap();
    let pinned = PinnedBuffer::<u32>::new(ctx, 16).unwrap();
    assert!(matches!(
        device.copy_range_from_host(0, &[]),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert_eq!(
        device.copy_range_from_host(14, &[1, 2, 3]),
        Err(MemoryError::OutOfRange {
            operation: "Buffer::copy_range_from_host",
            offset: 14,
            len: 3,
            capacity: 16
        })
    );
    assert!(matches!(
        pinned.copy_range_to_host(usize::MAX, &mut [0; 2]),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert_eq!(
        device.copy_from_host(&[1, 2, 3]),
        Err(MemoryError::SizeMismatch {
            operation: "Buffer::copy_from_host",
            expected: 16,
            actual: 3
        })
    );
    assert!(matches!(
        device.copy_to_host(&mut [0; 17]),
        Err(MemoryError::SizeMismatch { .. })
    ));
    let shorter = DeviceBuffer::<u32>::zeroed(ctx, 8).unwrap();
    assert!(matches!(
        device.copy_from(&shorter),
        Err(MemoryError::SizeMismatch { .. })
    ));
    assert!(matches!(
        device.copy_range_from(10, &shorter, 0, 8),
        Err(MemoryError::OutOfRange { .. })
    ));
    // Refused host copies hand their owned host side back, unchanged.
    let refused = device
        .copy_from_host_async(vec![1u32; 15], &s)
        .expect_err("a shorter Vec was copied");
    assert!(matches!(refused.error(), MemoryError::SizeMismatch { .. }));
    assert_eq!(refused.into_host(), Some(vec![1u32; 15]));
    let refused = device
        .copy_range_to_host_async(10, vec![3u32; 7].into_boxed_slice(), &s)
        .expect_err("a range past the end was copied");
    assert!(matches!(refused.error(), MemoryError::OutOfRange { .. }));
    assert_eq!(refused.into_host().as_deref(), Some(&[3u32; 7][..]));
    assert!(matches!(
        device.copy_range_from_async(0, &pinned, 0, 0, &s),
        Err(MemoryError::ZeroLength { .. })
    ));
    // Nothing above changed the buffers.
    assert_eq!(device.to_vec().unwrap(), vec![0u32; 16]);
    assert_eq!(pinned.as_slice().unwrap(), &[0u32; 16]);
}

#[test]
fn a_block_dropped_behind_its_streams_queued_fill_is_not_written_early_by_its_next_buffer() {
    // `a` is filled with 1.0 on `s` behind a long spin and dropped at once; `b` comes from the
    // same stream's free list. `b` starts with an empty tracker and may be used anywhere: if
    // the block were handed out again before `a`'s fill ran (stream order on `s` covers only
    // work on `s`), `b`'s own write on another stream, or on the legacy stream, would land first
    // and `a`'s late fill would overwrite it.
    const LEN: usize = 1 << 20;
    let _serial = serial();
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (s, t) = (stream(&gpu.context), stream(&gpu.context));
    let allocator = cuweave_memory::caching::CachingAllocator::with_driver(&gpu.context);
    for on_legacy in [false, true] {
        let mut a = allocator.buffer::<f32>(LEN, &s).unwrap();
        kernels.spin_ns(&s, 200 * MS).unwrap();
        a.fill_async(1.0, &s).unwrap();
        drop(a);
        let mut b = allocator.buffer::<f32>(LEN, &s).unwrap();
        if on_legacy {
            b.copy_from_host(&vec![2.0f32; LEN]).unwrap();
        } else {
            b.fill_async(2.0, &t).unwrap();
        }
        // `a`'s fill has run by now, wherever the block went.
        s.synchronize().unwrap();
        let back = b.to_vec().unwrap();
        assert!(
            back.iter().all(|&x| x == 2.0),
            "b's write (on {}) was overwritten by a's queued fill",
            if on_legacy {
                "the legacy stream"
            } else {
                "another stream"
            }
        );
    }
}

/// A data loader checksums the pinned batch it has just queued for upload, while the upload
/// still waits behind a 1 s kernel: the host's read of the pinned buffer does not wait for the
/// device's read of it (both only read), and sees the batch; a host write does wait (and
/// `try_as_mut_slice` is refused meanwhile), and the device gets the batch, not the write.
/// Unified memory, read by a device copy, behaves the same where the host may touch it.
#[test]
fn host_reads_go_on_beside_queued_device_reads_and_host_writes_wait_for_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(ctx);
    let data = pattern(1 << 16);
    let mut pinned = PinnedBuffer::from_slice(ctx, &data).unwrap();
    let mut device = DeviceBuffer::<u32>::zeroed(ctx, data.len()).unwrap();
    kernels.spin_ns(&s, 1000 * MS).unwrap();
    std::mem::forget(device.copy_from_host_async(&mut pinned, &s).unwrap());
    let sum: u64 = pinned
        .as_slice()
        .unwrap()
        .iter()
        .map(|&x| u64::from(x))
        .sum();
    assert_eq!(sum, data.iter().map(|&x| u64::from(x)).sum::<u64>());
    assert!(
        !s.query().unwrap(),
        "the host read waited for the queued upload, which only reads the buffer"
    );
    assert_eq!(pinned.try_as_slice().unwrap(), &data[..]);
    assert!(matches!(
        pinned.try_as_mut_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    pinned.as_mut_slice().unwrap().fill(0);
    assert!(s.query().unwrap(), "the host write waited for the upload");
    assert_eq!(device.to_vec().unwrap(), data);

    if !gpu
        .device
        .supports_concurrent_managed_access()
        .unwrap_or(false)
    {
        return;
    }
    let unified = UnifiedBuffer::from_slice(ctx, &data).unwrap();
    let mut copy = DeviceBuffer::<u32>::zeroed(ctx, data.len()).unwrap();
    kernels.spin_ns(&s, 1000 * MS).unwrap();
    copy.copy_from_async(&unified, &s).unwrap();
    assert_eq!(unified.as_slice().unwrap(), &data[..]);
    assert!(
        !s.query().unwrap(),
        "the host read of unified memory waited for a device copy that only reads it"
    );
    s.synchronize().unwrap();
    assert_eq!(copy.to_vec().unwrap(), data);
}
