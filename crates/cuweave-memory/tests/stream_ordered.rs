//! Typed buffers on the caching allocator, freed in stream order, on a real GPU: a drop never
//! waits for other streams' work, and memory a kernel still reads after its buffer was dropped is
//! not handed to an allocation on another stream (with the control run, ordering removed, that
//! does see the reuse).

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::{Buffer, CachingAllocator, DeviceBuffer, DriverResource, MemoryError};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};

mod common;

use common::{counter, read_u32};

const MIB: usize = 1 << 20;
/// How long the watch kernel reads a dropped buffer.
const WATCH_NS: u64 = 200_000_000;
/// The unrelated long kernel a drop must not wait for.
const LONG_NS: u64 = 300_000_000;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

#[test]
fn a_drop_returns_at_once_while_a_long_kernel_runs_on_another_stream() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).expect("kernels");
    let (a, b) = (stream(&gpu.context), stream(&gpu.context));
    for on_stream in [false, true] {
        let mut buffer = if on_stream {
            DeviceBuffer::<u8>::new_on(&b, MIB).expect("new_on")
        } else {
            DeviceBuffer::<u8>::new(&gpu.context, MIB).expect("new")
        };
        kernels.spin_ns(&a, LONG_NS).expect("long kernel");
        buffer.fill_async(7, &b).expect("fill");
        let begin = Instant::now();
        drop(buffer);
        let took = begin.elapsed();
        assert!(
            !a.query().expect("query a"),
            "the long kernel is still running after the drop"
        );
        eprintln!("drop (new_on: {on_stream}) during a 300 ms kernel: {took:?}");
        assert!(
            took < Duration::from_millis(50),
            "the drop waited {took:?} for another stream's work"
        );
        a.synchronize().expect("sync a");
        b.synchronize().expect("sync b");
    }
}

/// Drops a buffer that a 200 ms watch kernel on `s2` still reads, then allocates the same size
/// on `s1` from the same allocator and fills it. Returns (old address, new address, mismatches).
fn drop_under_watch(context: &Arc<Context>, ordered: bool) -> (u64, u64, u32) {
    const EXPECTED: u32 = 0xA5A5_A5A5;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let (s1, s2) = (stream(context), stream(context));
    let n = MIB / 4;
    let mismatches = counter(context);
    let mut old = allocator.buffer::<u32>(n, &s1).expect("old");
    old.fill_async(EXPECTED, &s1).expect("fill old");
    if ordered {
        old.prepare_read(&s2)
            .expect("order the watch after the fill");
    } else {
        let filled = Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
        filled.record(&s1).expect("record");
        s2.wait_event(&filled).expect("wait");
    }
    // SAFETY: `old` holds n u32s; its memory stays allocated (in the cache) until the allocator
    // is dropped, after both streams are synchronised below; the control run reuses it while
    // watched on purpose, which the kernel tolerates (it only reads). `mismatches` outlives s2.
    unsafe {
        kernels
            .watch_u32(
                &s2,
                old.device_ptr(),
                n,
                EXPECTED,
                WATCH_NS,
                mismatches.ptr(),
            )
            .expect("watch");
    }
    if ordered {
        old.record_read(&s2).expect("record the watch");
    }
    let old_ptr = old.device_ptr();
    drop(old);
    let mut new = allocator.buffer::<u32>(n, &s1).expect("new");
    new.fill_async(!EXPECTED, &s1).expect("fill new");
    assert!(
        !s2.query().expect("query s2"),
        "the watch kernel must still be running when the memory is allocated again"
    );
    s2.synchronize().expect("sync s2");
    s1.synchronize().expect("sync s1");
    let new_ptr = new.device_ptr();
    drop(new);
    (old_ptr, new_ptr, read_u32(context, mismatches.ptr()))
}

#[test]
fn a_dropped_buffer_is_not_reused_while_a_kernel_on_another_stream_reads_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (old, new, mismatches) = drop_under_watch(&gpu.context, true);
    assert_ne!(old, new, "the block still watched was not handed out");
    assert_eq!(mismatches, 0, "the watch kernel saw its data unchanged");
}

#[test]
fn without_the_recorded_read_the_watch_kernel_sees_the_reuse() {
    // The control: the watch does catch a reuse, so the zero above means the drop prevented one.
    let gpu = require_gpu!();
    let _serial = serial();
    let (old, new, mismatches) = drop_under_watch(&gpu.context, false);
    assert_eq!(old, new, "unrecorded, the block comes straight back");
    assert!(mismatches > 0, "the watch kernel saw the new fill");
}

#[test]
fn a_buffer_reuses_the_cache_and_round_trips() {
    let gpu = require_gpu!();
    // The default allocator's counters are shared with the other tests here.
    let _serial = serial();
    let s = stream(&gpu.context);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    let mut first = allocator.buffer::<u32>(1000, &s).expect("first");
    first.copy_from_host(&[9; 1000]).expect("upload");
    assert_eq!(first.to_vec().expect("download"), vec![9; 1000]);
    let ptr = first.device_ptr();
    drop(first);
    let second = allocator.buffer::<u32>(1000, &s).expect("second");
    assert_eq!(second.device_ptr(), ptr, "served from the cache");
    assert_eq!(allocator.stats().cache_hits, 1);
    // The default allocator serves new_on and new.
    let default = CachingAllocator::for_device(gpu.context.device()).expect("default");
    let before = default.stats().allocations;
    let third = DeviceBuffer::<u8>::new_on(&s, 4096).expect("third");
    assert_eq!(default.stats().allocations, before + 1);
    drop(third);
}

#[test]
fn bad_requests_are_typed_errors() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    assert!(matches!(
        DeviceBuffer::<u32>::new_on(&s, 0),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        DeviceBuffer::<u64>::new_on(&s, usize::MAX / 4),
        Err(MemoryError::Misaligned { .. })
    ));
    // SAFETY: CU_STREAM_PER_THREAD (2) is a valid stream of every context; not owned.
    let per_thread =
        unsafe { Stream::from_raw(&gpu.context, 2usize as cuweave_driver::sys::CUstream, false) };
    assert!(matches!(
        DeviceBuffer::<u32>::new_on(&per_thread, 16),
        Err(MemoryError::InvalidStream { .. })
    ));
    let allocator = CachingAllocator::with_driver(&gpu.context);
    assert!(matches!(
        allocator.allocate(16, &per_thread),
        Err(MemoryError::InvalidStream { .. })
    ));
}

#[test]
fn a_buffer_of_another_resource_frees_in_stream_order() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let resource = Arc::new(DriverResource::new(&gpu.context));
    let mut buffer =
        DeviceBuffer::<u32>::with_resource(resource.clone(), 256, &s).expect("with_resource");
    buffer.fill_async(3, &s).expect("fill");
    assert_eq!(buffer.to_vec().expect("read"), vec![3; 256]);
    assert_eq!(buffer.resource_name(), "driver");
    assert_eq!(resource.outstanding(), 1);
    drop(buffer);
    assert_eq!(
        resource.outstanding(),
        0,
        "deallocated through the resource"
    );
}

#[test]
fn the_default_allocator_can_be_replaced() {
    let gpu = require_gpu!();
    let _serial = serial();
    let s = stream(&gpu.context);
    let device = gpu.context.device();
    let limited = CachingAllocator::new(Arc::new(cuweave_memory::LimitAdaptor::new(
        DriverResource::new(&gpu.context),
        64 * MIB,
    )));
    let previous = CachingAllocator::set_default_for_device(limited.clone());
    let buffer = DeviceBuffer::<u8>::new_on(&s, MIB).expect("from the new default");
    assert_eq!(limited.stats().allocations, 1, "served by the replacement");
    assert!(
        DeviceBuffer::<u8>::new_on(&s, 128 * MIB)
            .expect_err("past the limit")
            .is_out_of_memory()
    );
    drop(buffer);
    if let Some(previous) = previous {
        CachingAllocator::set_default_for_device(previous);
    }
    let back = CachingAllocator::for_device(device).expect("default");
    let before = back.stats().allocations;
    drop(DeviceBuffer::<u8>::new_on(&s, MIB).expect("from the restored default"));
    assert_eq!(
        back.stats().allocations,
        before + 1,
        "served by the restored default"
    );
    assert_eq!(
        limited.stats().allocations,
        1,
        "the replacement is no longer used"
    );
}
