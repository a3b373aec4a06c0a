//! GPU tests of fills through views that do not start on a word boundary: every element of the
//! view takes the value, every byte outside it keeps what it held, whatever the element type and
//! offset, blocking and on a stream.
//!
//! A view's first byte is its first element's: `slice_mut(1..5)` of a `u16` buffer starts 2
//! bytes in, where the driver refuses a 32-bit memset (`CUDA_ERROR_INVALID_VALUE`).

use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::Element;
use cuweave_memory::buffer::{Buffer, DeviceBuffer};
use cuweave_test_support::require_gpu;

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Fills elements `start..end` of a buffer of `len` elements (all `background` before) with
/// `value`, blocking then (with `other`) on a non-blocking stream, and checks every element,
/// inside and outside the view.
fn check_view_fill<T: Element + PartialEq + Debug>(
    context: &Arc<Context>,
    len: usize,
    start: usize,
    end: usize,
    [background, value, other]: [T; 3],
) {
    let expect = |inside: T| -> Vec<T> {
        (0..len)
            .map(|i| {
                if (start..end).contains(&i) {
                    inside
                } else {
                    background
                }
            })
            .collect()
    };
    let mut buffer = DeviceBuffer::<T>::new(context, len).unwrap();
    buffer.copy_from_host(&vec![background; len]).unwrap();
    buffer.slice_mut(start..end).unwrap().fill(value).unwrap();
    assert_eq!(
        buffer.to_vec().unwrap(),
        expect(value),
        "blocking fill of {start}..{end} of {len} {}",
        std::any::type_name::<T>()
    );

    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    buffer.copy_from_host(&vec![background; len]).unwrap();
    buffer
        .slice_mut(start..end)
        .unwrap()
        .fill_async(other, &stream)
        .unwrap();
    let back = buffer
        .copy_to_host_async(vec![value; len], &stream)
        .unwrap()
        .wait()
        .unwrap();
    assert_eq!(
        back,
        expect(other),
        "async fill of {start}..{end} of {len} {}",
        std::any::type_name::<T>()
    );
}

#[test]
fn u16_view_two_bytes_in_is_filled_without_a_misaligned_word_memset() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    // The reviewer's case: 10 `u16`, elements 1..5 (8 bytes from byte 2, a whole number of
    // words but not word aligned), then odd element offsets and counts around it.
    check_view_fill::<u16>(ctx, 10, 1, 5, [0xffff, 7, 0x0102]);
    for (start, end) in [(1, 2), (1, 3), (3, 9), (2, 6), (0, 3), (5, 10), (9, 10)] {
        check_view_fill::<u16>(ctx, 10, start, end, [0xeeee, 0x0102, 0xabcd]);
    }
    // Large enough for the pattern path to double on the device.
    check_view_fill::<u16>(ctx, 300_001, 1, 300_000, [0, 0x1234, 0x5678]);
}

#[test]
fn u8_views_at_odd_offsets_touch_only_their_bytes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    for (start, end) in [(1, 2), (1, 5), (3, 8), (3, 4), (5, 17), (0, 1), (15, 17)] {
        check_view_fill::<u8>(ctx, 17, start, end, [0x55, 0xab, 0x01]);
    }
    check_view_fill::<u8>(ctx, 1 << 20, 3, (1 << 20) - 1, [0, 0xcd, 0x7f]);
}

#[test]
fn f64_and_wide_values_fill_views_at_every_element_offset() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    for (start, end) in [(1, 2), (1, 4), (3, 7), (0, 7), (6, 7)] {
        check_view_fill::<f64>(ctx, 7, start, end, [-1.0, 2.5, 1e-300]);
        // Equal halves: a word memset where aligned (every f64 element is).
        check_view_fill::<u64>(
            ctx,
            7,
            start,
            end,
            [0, 0x0a0b_0c0d_0a0b_0c0d, 0x1122_3344_1122_3344],
        );
        // A 2-byte period in a 6-byte element: views start 2 bytes off a word every other one.
        check_view_fill::<[u8; 6]>(
            ctx,
            7,
            start,
            end,
            [[9; 6], [1, 2, 1, 2, 1, 2], [3, 4, 3, 4, 3, 4]],
        );
    }
    check_view_fill::<f64>(ctx, 100_003, 1, 100_002, [0.0, 3.25, -7.5]);
}

/// `split_at_mut` and `chunks_mut`: writable views of disjoint parts, each filled on its own
/// stream at once. The head's fill waits behind a closed gate while the tail's runs and lands
/// (disjoint parts order nothing), every element ends with its part's value, a read-only view
/// stays read-only when split, and bad splits are typed errors.
#[test]
fn split_and_chunked_views_are_written_on_their_own_streams_at_once() {
    use cuweave_memory::MemoryError;
    use cuweave_test_support::kernels::TestKernels;

    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let (held, free) = (
        Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap(),
        Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap(),
    );
    const LEN: usize = 1001;
    let mut buffer = DeviceBuffer::<u16>::zeroed(ctx, LEN).unwrap();
    {
        let gate = Gate::new(ctx);
        gate.hold(&kernels, &held);
        let (mut head, mut tail) = buffer.split_at_mut(333).unwrap();
        assert_eq!((head.len(), tail.len()), (333, LEN - 333));
        head.fill_async(1, &held).unwrap();
        tail.fill_async(2, &free).unwrap();
        free.synchronize().unwrap();
        assert!(
            !held.query().unwrap(),
            "the head's fill still waits at the gate"
        );
        gate.open();
        held.synchronize().unwrap();
    }
    let expected: Vec<u16> = (0..LEN).map(|i| if i < 333 { 1 } else { 2 }).collect();
    assert_eq!(buffer.to_vec().unwrap(), expected);

    // Slots of a flat buffer, the last one short, each on a stream of its own.
    let streams: Vec<Stream> = (0..4)
        .map(|_| Stream::new(ctx, StreamFlags::NON_BLOCKING).unwrap())
        .collect();
    let mut slots = buffer.chunks_mut(300).unwrap();
    assert_eq!(
        slots.iter().map(|slot| slot.len()).collect::<Vec<_>>(),
        [300, 300, 300, 101]
    );
    for (i, slot) in slots.iter_mut().enumerate() {
        slot.fill_async(10 + i as u16, &streams[i]).unwrap();
    }
    drop(slots);
    let expected: Vec<u16> = (0..LEN).map(|i| 10 + (i / 300) as u16).collect();
    assert_eq!(
        buffer.to_vec().unwrap(),
        expected,
        "the blocking read waited for all four streams"
    );

    // A split of a split, and of a read-only view: the parts of a read-only view refuse writes.
    let (_, mut tail) = buffer.split_at_mut(1).unwrap();
    let (mut middle, _) = tail.split_at_mut(LEN - 2).unwrap();
    middle.fill(7).unwrap();
    let back = buffer.to_vec().unwrap();
    assert_eq!(
        (back[0], back[1], back[LEN - 2], back[LEN - 1]),
        (10, 7, 7, 13)
    );
    let mut read_only = buffer.slice(..).unwrap();
    let (mut a, _) = read_only.split_at_mut(5).unwrap();
    assert!(matches!(a.fill(0), Err(MemoryError::ReadOnlyView { .. })));
    assert_eq!(buffer.to_vec().unwrap(), back, "nothing was written");

    for mid in [0, LEN] {
        assert!(matches!(
            buffer.split_at_mut(mid),
            Err(MemoryError::ZeroLength { .. })
        ));
    }
    assert!(matches!(
        buffer.split_at_mut(LEN + 1),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        buffer.chunks_mut(0),
        Err(MemoryError::ZeroLength { .. })
    ));
}
