//! GPU tests of unified memory: host access waits for the buffer's last stream; every advice and
//! prefetch reads back through `cuMemRangeGetAttribute`; data survives host → device (changed by
//! a kernel) → host; prefetch plans and policies take effect; raw ranges and targets are checked.
//! Managed allocations stay at 16 MiB or less.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cuweave_driver::graph::CaptureMode;
use cuweave_driver::memory::{
    self, DeviceAllocation, ManagedAllocation, MemLocation, range_accessed_by,
    range_last_prefetch_location, range_preferred_location, range_read_mostly,
};
use cuweave_driver::{Context, DriverError, InstantiateOptions, Stream, StreamFlags};
use cuweave_memory::MemoryError;
use cuweave_memory::buffer::{Buffer, UnifiedBuffer};
use cuweave_memory::caching::{GraphPool, MissPolicy, begin_allocate_to_pool};
use cuweave_memory::unified::{
    ManagedCapabilities, ManagedMemoryHints, MemAdvice, MigrationPolicy, PrefetchPath, PrefetchPlan,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;

/// Serializes this file's GPU tests. Several assert that host access is refused while a spin
/// kernel runs; a driver call in a concurrent test (a free or a pinning, which wait for the whole
/// device and hold driver locks meanwhile) could block this thread until the spin has ended.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}
/// 16 MiB of `u32`.
const LEN: usize = 4 << 20;
const DEVICE: MemLocation = MemLocation::Device(0);

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

fn managed(context: &Arc<Context>) -> UnifiedBuffer<u32> {
    let mut buffer = UnifiedBuffer::<u32>::new(context, LEN).expect("managed buffer");
    for (i, x) in buffer.as_mut_slice().unwrap().iter_mut().enumerate() {
        *x = i as u32;
    }
    buffer
}

fn read_mostly(ctx: &Context, b: &UnifiedBuffer<u32>) -> bool {
    range_read_mostly(ctx, b.device_ptr(), b.byte_size()).unwrap()
}

fn preferred(ctx: &Context, b: &UnifiedBuffer<u32>) -> Option<MemLocation> {
    range_preferred_location(ctx, b.device_ptr(), b.byte_size()).unwrap()
}

fn accessed_by(ctx: &Context, b: &UnifiedBuffer<u32>) -> Vec<MemLocation> {
    range_accessed_by(ctx, b.device_ptr(), b.byte_size()).unwrap()
}

fn last_prefetch(ctx: &Context, ptr: u64, bytes: usize) -> Option<MemLocation> {
    range_last_prefetch_location(ctx, ptr, bytes).unwrap()
}

#[test]
fn capabilities_match_the_device_attributes() {
    let gpu = require_gpu!();
    let _serial = serial();
    let caps = ManagedCapabilities::of(gpu.device).unwrap();
    assert_eq!(caps.device, 0);
    assert_eq!(
        caps.managed_memory,
        gpu.device.supports_managed_memory().unwrap()
    );
    assert_eq!(
        caps.concurrent_managed_access,
        gpu.device.supports_concurrent_managed_access().unwrap()
    );
    assert!(
        caps.managed_memory && caps.concurrent_managed_access,
        "the rest of these tests need a device with concurrent managed access"
    );
}

#[test]
fn host_access_waits_for_the_buffers_last_stream() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(ctx);
    let mut buffer = managed(ctx);

    // A prefetch queued behind a 50 ms spin: the buffer's last use is still pending.
    kernels.spin_ns(&s, 50 * MS).unwrap();
    buffer.prefetch_to(DEVICE, &s).unwrap();
    assert_eq!(buffer.last_use(), Some(s.as_raw() as usize));
    assert!(matches!(
        buffer.try_as_slice(),
        Err(MemoryError::DeviceBusy { stream, .. }) if stream == s.as_raw() as usize
    ));
    let slice = buffer.as_slice().unwrap(); // waits
    assert_eq!(slice[12_345], 12_345);
    assert!(buffer.try_as_slice().is_ok());

    // A prefetch, then a 50 ms spin kernel reported as a use of the buffer.
    buffer.prefetch_to(DEVICE, &s).unwrap();
    kernels.spin_ns(&s, 50 * MS).unwrap();
    buffer.record_use(&s).unwrap();
    assert!(matches!(
        buffer.try_as_mut_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    buffer.as_mut_slice().unwrap()[0] = 99; // waits
    assert_eq!(buffer.as_slice().unwrap()[0], 99);
}

#[test]
fn every_advice_reads_back_from_the_driver() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let buffer = managed(ctx);
    let hints = buffer.hints().unwrap();

    hints.set_read_mostly().unwrap();
    assert!(read_mostly(ctx, &buffer));
    assert!(hints.read_mostly().unwrap());
    hints.unset_read_mostly().unwrap();
    assert!(!read_mostly(ctx, &buffer));

    hints.set_preferred_location(DEVICE).unwrap();
    assert_eq!(preferred(ctx, &buffer), Some(DEVICE));
    hints.set_preferred_location(MemLocation::Host).unwrap();
    assert_eq!(preferred(ctx, &buffer), Some(MemLocation::Host));
    assert_eq!(hints.preferred_location().unwrap(), Some(MemLocation::Host));
    hints.unset_preferred_location().unwrap();
    assert_eq!(preferred(ctx, &buffer), None);

    hints.set_accessed_by(DEVICE).unwrap();
    assert_eq!(accessed_by(ctx, &buffer), vec![DEVICE]);
    hints.unset_accessed_by(DEVICE).unwrap();
    assert_eq!(accessed_by(ctx, &buffer), vec![]);
    hints.set_accessed_by(MemLocation::Host).unwrap();
    assert_eq!(accessed_by(ctx, &buffer), vec![MemLocation::Host]);
    buffer
        .advise(MemAdvice::UnsetAccessedBy(MemLocation::Host))
        .unwrap();
    assert!(hints.accessed_by().unwrap().is_empty());

    // Advice on part of the buffer applies to that part only.
    let first = buffer.range(0, LEN / 2).unwrap();
    let (ptr, half) = (first.ptr(), first.bytes());
    ManagedMemoryHints::for_range(first)
        .unwrap()
        .set_read_mostly()
        .unwrap();
    assert!(range_read_mostly(ctx, ptr, half).unwrap());
    assert!(!range_read_mostly(ctx, ptr + half as u64, half).unwrap());
    assert!(!hints.read_mostly().unwrap());
}

#[test]
fn data_survives_host_to_device_kernel_and_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(ctx);
    let buffer = managed(ctx);
    let (ptr, bytes) = (buffer.device_ptr(), buffer.byte_size());

    buffer.prefetch_to(DEVICE, &s).unwrap();
    assert_eq!(last_prefetch(ctx, ptr, bytes), Some(DEVICE));
    buffer.prepare_use(&s).unwrap();
    // SAFETY: the buffer holds LEN u32s and outlives the kernel (its drop and host access wait
    // for the use recorded below).
    unsafe { kernels.increment_u32(&s, ptr, LEN) }.unwrap();
    buffer.record_use(&s).unwrap();
    buffer.prefetch_to(MemLocation::Host, &s).unwrap();
    assert_eq!(last_prefetch(ctx, ptr, bytes), Some(MemLocation::Host));
    let host = buffer.as_slice().unwrap();
    assert!(host.iter().enumerate().all(|(i, &x)| x == i as u32 + 1));

    // A ranged prefetch moves only its range.
    let hints = buffer.hints().unwrap();
    hints.prefetch_range(LEN / 4, LEN / 4, DEVICE, &s).unwrap();
    let quarter = ptr + (LEN / 4 * 4) as u64;
    assert_eq!(last_prefetch(ctx, quarter, bytes / 4), Some(DEVICE));
    assert_eq!(last_prefetch(ctx, ptr, bytes / 4), Some(MemLocation::Host));
    assert_eq!(hints.last_prefetch_location().unwrap(), None); // mixed over the whole range
    s.synchronize().unwrap();
}

#[test]
fn a_prefetch_plan_executes_and_its_targets_read_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let kernels = TestKernels::load(ctx).unwrap();
    let s = stream(ctx);
    let (a, b) = (managed(ctx), managed(ctx));
    let expected_path = if cuweave_driver::driver()
        .unwrap()
        .mem_prefetch_batch_async
        .is_available()
    {
        PrefetchPath::Batched
    } else {
        PrefetchPath::PerRange
    };

    let mut plan = PrefetchPlan::new();
    plan.add(&a, DEVICE)
        .unwrap()
        .add(b.range(0, LEN / 2).unwrap(), DEVICE)
        .unwrap()
        .add(b.range(LEN / 2, LEN / 2).unwrap(), MemLocation::Host)
        .unwrap();
    assert_eq!((plan.len(), plan.total_bytes()), (3, 2 * LEN * 4));
    kernels.spin_ns(&s, 20 * MS).unwrap();
    assert_eq!(plan.execute(&s).unwrap(), expected_path);
    // The plan's stream is now both buffers' last use.
    assert!(matches!(
        b.try_as_slice(),
        Err(MemoryError::DeviceBusy { .. })
    ));
    let half = LEN / 2 * 4;
    assert_eq!(last_prefetch(ctx, a.device_ptr(), LEN * 4), Some(DEVICE));
    assert_eq!(last_prefetch(ctx, b.device_ptr(), half), Some(DEVICE));
    assert_eq!(
        last_prefetch(ctx, b.device_ptr() + half as u64, half),
        Some(MemLocation::Host)
    );
    assert_eq!(b.as_slice().unwrap()[LEN - 1], LEN as u32 - 1);

    plan.clear();
    plan.add(&a, MemLocation::Host).unwrap();
    assert_eq!(plan.execute(&s).unwrap(), expected_path);
    assert_eq!(
        last_prefetch(ctx, a.device_ptr(), LEN * 4),
        Some(MemLocation::Host)
    );
    assert_eq!(a.as_slice().unwrap()[7], 7);

    plan.clear();
    assert!(matches!(
        plan.execute(&s),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        plan.add(&a, MemLocation::Device(99)),
        Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
    ));
    assert!(plan.is_empty());
    assert!(matches!(
        b.range(LEN, 1),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(b.range(0, 0), Err(MemoryError::ZeroLength { .. })));
}

#[test]
fn policies_apply_and_read_back() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let buffer = managed(ctx);
    let check = |policy: MigrationPolicy,
                 mostly: bool,
                 place: Option<MemLocation>,
                 accessors: Vec<MemLocation>| {
        buffer.apply_policy(&policy).unwrap();
        assert_eq!(read_mostly(ctx, &buffer), mostly, "{policy}");
        assert_eq!(preferred(ctx, &buffer), place, "{policy}");
        assert_eq!(accessed_by(ctx, &buffer), accessors, "{policy}");
    };
    check(
        MigrationPolicy::PreferDevice(0),
        false,
        Some(DEVICE),
        vec![DEVICE],
    );
    check(MigrationPolicy::ReadMostly, true, None, vec![]);
    check(
        MigrationPolicy::PreferHost,
        false,
        Some(MemLocation::Host),
        vec![],
    );
    check(
        MigrationPolicy::PreferDevice(0),
        false,
        Some(DEVICE),
        vec![DEVICE],
    );
    check(MigrationPolicy::Default, false, None, vec![]);
    // A policy aimed at a device that does not exist changes nothing.
    buffer.apply_policy(&MigrationPolicy::ReadMostly).unwrap();
    assert!(matches!(
        buffer.apply_policy(&MigrationPolicy::PreferDevice(99)),
        Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
    ));
    assert!(read_mostly(ctx, &buffer));
}

#[test]
fn raw_ranges_and_targets_are_checked() {
    let gpu = require_gpu!();
    let _serial = serial();
    let ctx = &gpu.context;
    let s = stream(ctx);
    let allocation = ManagedAllocation::new(ctx, 1 << 20).unwrap();
    let plain = DeviceAllocation::new(ctx, 1 << 20).unwrap();

    // SAFETY: `allocation` outlives the hints and every prefetch below (synchronized at the end).
    let hints = unsafe { ManagedMemoryHints::from_raw(ctx, allocation.ptr(), 1 << 20) }.unwrap();
    hints.set_preferred_location(DEVICE).unwrap();
    assert_eq!(
        range_preferred_location(ctx, allocation.ptr(), 1 << 20).unwrap(),
        Some(DEVICE)
    );
    hints.prefetch_range(4096, 8192, DEVICE, &s).unwrap();
    assert_eq!(
        range_last_prefetch_location(ctx, allocation.ptr() + 4096, 8192).unwrap(),
        Some(DEVICE)
    );
    assert!(matches!(
        hints.prefetch_range(1 << 20, 1, DEVICE, &s),
        Err(MemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        hints.prefetch_range(8, 0, DEVICE, &s),
        Err(MemoryError::ZeroLength { .. })
    ));
    assert!(matches!(
        hints.prefetch_to(MemLocation::Device(99), &s),
        Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
    ));
    assert!(matches!(
        hints.set_accessed_by(MemLocation::Device(99)),
        Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
    ));

    // SAFETY: the allocations outlive these calls, which all fail before any advice.
    unsafe {
        assert!(matches!(
            ManagedMemoryHints::from_raw(ctx, allocation.ptr(), 0),
            Err(MemoryError::ZeroLength { .. })
        ));
        assert!(matches!(
            ManagedMemoryHints::from_raw(ctx, allocation.ptr() + 4096, 1 << 20),
            Err(MemoryError::OutOfRange { .. })
        ));
        assert!(matches!(
            ManagedMemoryHints::from_raw(ctx, plain.ptr(), 4096),
            Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
        ));
    }
    s.synchronize().unwrap();
    assert!(
        memory::pointer_attributes(allocation.ptr())
            .unwrap()
            .is_managed
    );
}

#[test]
fn a_unified_buffer_a_graph_writes_is_freed_only_when_the_graphs_pool_dies() {
    // The capture's graph writes the buffer at its address on every replay: dropping the buffer
    // while the graph lives must not free the managed memory under it (the drop used to wait
    // only for eager uses, then free).
    let _serial = serial();
    let gpu = require_gpu!();
    let ctx = &gpu.context;
    if !ManagedCapabilities::of(ctx.device())
        .unwrap()
        .managed_memory
    {
        return;
    }
    let stream = stream(ctx);
    let mut buffer = UnifiedBuffer::<u32>::new(ctx, 1 << 16).unwrap();
    let ptr = buffer.device_ptr();
    let graphs = GraphPool::new();
    stream
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let routed = begin_allocate_to_pool(&stream, &graphs, MissPolicy::default()).unwrap();
    buffer.fill_async(7, &stream).unwrap();
    let mut graph = stream.end_capture().unwrap();
    drop(routed);
    graph.keep_alive(graphs.keep_alive());
    drop(graphs);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    drop(buffer);
    assert_eq!(
        memory::address_range(ctx, ptr).unwrap().0,
        ptr,
        "the managed memory was freed under a live graph"
    );
    for _ in 0..3 {
        exec.launch(&stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(memory::address_range(ctx, ptr).is_ok());
    drop(exec);
    drop(graph);
    assert!(
        memory::address_range(ctx, ptr).is_err(),
        "freed once the graph's pool died"
    );
}
