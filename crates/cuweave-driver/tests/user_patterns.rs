//! What cudarc users and people writing raw CUDA driver programs in Rust do with the driver
//! layer, each checked by its outcome on the GPU: launch shapes and arguments the kernel echoes
//! back, typed errors for what cannot run, events that order and time, pools that stay
//! bounded, handles that travel between threads and through raw handles, raw memory that
//! round-trips byte for byte, graphs relaunched and updated, and a machine without a driver.

mod common;

use common::echoed;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use cuweave_driver::memory::{
    self, CompletionWords, DeviceAllocation, HostAllocFlags, HostAllocation, ManagedAllocation,
    MemoryPool, MemoryType,
};
use cuweave_driver::{
    CaptureMode, Context, Device, DriverError, Event, EventFlags, EventPool, GraphError,
    InstantiateOptions, Kernel, KernelArgs, LaunchConfig, Module, Stream, StreamFlags, sys,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::launch_kernels::{LaunchKernels, Pair};
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;
const MIB: usize = 1 << 20;

/// `n` zeroed `u32`s of device memory.
fn zeroed_u32(context: &Arc<Context>, n: usize) -> DeviceAllocation {
    let buffer = DeviceAllocation::new(context, n * 4).unwrap();
    // SAFETY: the allocation holds `n` u32s.
    unsafe { memory::memset_d32(context, buffer.ptr(), 0, n) }.unwrap();
    buffer
}

/// The first `n` `u32`s of `buffer`, after all queued work on `stream`.
fn read_u32(buffer: &DeviceAllocation, n: usize, stream: &Stream) -> Vec<u32> {
    stream.synchronize().unwrap();
    let mut host = vec![0u32; n];
    // SAFETY: `host` holds `n` u32s and `buffer` at least as many.
    unsafe {
        memory::copy_dtoh(
            buffer.context(),
            host.as_mut_ptr().cast(),
            buffer.ptr(),
            n * 4,
        )
    }
    .unwrap();
    host
}

fn assert_driver_error<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::Cuda { .. } | DriverError::ModuleLoad { .. }) => {}
        other => panic!("{what}: expected the driver's error, got {other:?}"),
    }
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Modules and launches
// ---------------------------------------------------------------------------------------------

#[test]
fn launch_shapes_in_three_dimensions_run_every_thread_exactly_once() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let shapes = [
        ((1, 1, 1), (1, 1, 1)),
        ((1, 1, 1), (1024, 1, 1)),
        ((1, 1, 1), (8, 8, 16)),
        ((3, 2, 2), (8, 4, 2)),
        ((2, 3, 4), (4, 4, 4)),
        ((1, 65_535, 1), (2, 1, 1)),
        ((1, 1, 65_535), (1, 1, 1)),
        ((70_000, 1, 1), (32, 1, 1)),
    ];
    for (grid, block) in shapes {
        let threads = [grid.0, grid.1, grid.2, block.0, block.1, block.2]
            .iter()
            .map(|&d| d as usize)
            .product::<usize>();
        // One element more than threads: nothing may write past the launch.
        let counts = zeroed_u32(context, threads + 1);
        let ptr = counts.ptr();
        let args = KernelArgs::new().arg(&ptr);
        let config = LaunchConfig {
            grid,
            block,
            shared_mem_bytes: 0,
        };
        // SAFETY: count_threads_3d(unsigned*) matches; `counts` holds one u32 per thread of the
        // launch and outlives the synchronize in `read_u32`.
        unsafe { kernels.count_threads_3d().launch(&stream, config, &args) }.unwrap();
        let seen = read_u32(&counts, threads + 1, &stream);
        if let Some(bad) = seen[..threads].iter().position(|&count| count != 1) {
            panic!(
                "grid {grid:?} block {block:?}: thread {bad} ran {} times",
                seen[bad]
            );
        }
        assert_eq!(
            seen[threads], 0,
            "grid {grid:?} block {block:?} wrote past the launch"
        );
    }
}

#[test]
fn dynamic_shared_memory_up_to_the_default_limit_is_usable_and_more_is_a_typed_error() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const BLOCKS: usize = 6;
    let sums = DeviceAllocation::new(context, BLOCKS * 8).unwrap();
    for bytes in [4u32, 1024, 16 * 1024, 48 * 1024] {
        // SAFETY: `sums` holds BLOCKS u64s.
        unsafe { memory::memset_d8(context, sums.ptr(), 0xff, BLOCKS * 8) }.unwrap();
        let words = bytes / 4;
        let ptr = sums.ptr();
        let args = KernelArgs::new().arg(&words).arg(&ptr);
        let config = LaunchConfig {
            grid: (BLOCKS as u32, 1, 1),
            block: (128, 1, 1),
            shared_mem_bytes: bytes,
        };
        // SAFETY: shared_sum_u32(unsigned, unsigned long long*) matches; each block gets
        // `bytes` of dynamic shared memory, exactly `words` u32s; `sums` holds one u64 per block.
        unsafe { kernels.shared_sum_u32().launch(&stream, config, &args) }.unwrap();
        stream.synchronize().unwrap();
        let mut host = [0u64; BLOCKS];
        // SAFETY: `host` and `sums` hold BLOCKS u64s.
        unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), sums.ptr(), BLOCKS * 8) }
            .unwrap();
        let expected = u64::from(words) * u64::from(words - 1) / 2;
        assert_eq!(host, [expected; BLOCKS], "{bytes} bytes of shared memory");
    }
    // More than 48 KiB needs an opt-in the kernel has not made: the driver refuses the launch.
    let words = 0u32;
    let ptr = sums.ptr();
    let args = KernelArgs::new().arg(&words).arg(&ptr);
    let too_much = LaunchConfig {
        grid: (1, 1, 1),
        block: (32, 1, 1),
        shared_mem_bytes: 48 * 1024 + 4,
    };
    // SAFETY: as above; the launch is refused before anything runs.
    let refused = unsafe { kernels.shared_sum_u32().launch(&stream, too_much, &args) };
    assert_driver_error(refused, "a launch asking for 48 KiB + 4 of shared memory");
    // The refusal did not poison the context.
    let fine = LaunchConfig {
        shared_mem_bytes: 0,
        ..too_much
    };
    // SAFETY: as above with no shared memory and `words == 0`: the kernel writes sums[0].
    unsafe { kernels.shared_sum_u32().launch(&stream, fine, &args) }.unwrap();
    stream.synchronize().unwrap();
}

#[test]
fn a_kernel_opted_in_to_more_dynamic_shared_memory_launches_with_it() {
    use sys::CUfunction_attribute as F;
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let kernel = kernels.shared_sum_u32();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    // What cudarc users read before choosing a launch shape.
    assert!(kernel.attribute(F::CU_FUNC_ATTRIBUTE_NUM_REGS).unwrap() > 0);
    let max_threads = kernel
        .attribute(F::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
        .unwrap();
    assert!((1..=1024).contains(&max_threads), "{max_threads}");
    assert_eq!(
        kernel
            .attribute(F::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
            .unwrap(),
        0
    );
    let default = kernel
        .attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        .unwrap();
    assert!((1..=48 * 1024).contains(&default), "{default}");
    let opt_in = gpu
        .device
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .unwrap();
    if opt_in <= 48 * 1024 {
        cuweave_test_support::skip(
            "a_kernel_opted_in_to_more_dynamic_shared_memory_launches_with_it",
            "the device offers no more than 48 KiB of shared memory per block",
        );
        return;
    }
    // Past the device's limit: the driver's error, and the kernel keeps its setting.
    assert_driver_error(
        kernel.set_max_dynamic_shared_memory(opt_in as u32 + 1024),
        "more shared memory than the device has",
    );
    assert_invalid(
        kernel.set_max_dynamic_shared_memory(u32::MAX),
        "u32::MAX bytes of shared memory",
    );
    // The largest amount the device allows, and a launch that uses every byte of it.
    kernel.set_max_dynamic_shared_memory(opt_in as u32).unwrap();
    assert_eq!(
        kernel
            .attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            .unwrap(),
        opt_in
    );
    const BLOCKS: usize = 4;
    let sums = DeviceAllocation::new(context, BLOCKS * 8).unwrap();
    for bytes in [64 * 1024 + 4, opt_in as u32] {
        // SAFETY: `sums` holds BLOCKS u64s.
        unsafe { memory::memset_d8(context, sums.ptr(), 0xff, BLOCKS * 8) }.unwrap();
        let words = bytes / 4;
        let ptr = sums.ptr();
        let args = KernelArgs::new().arg(&words).arg(&ptr);
        let config = LaunchConfig {
            grid: (BLOCKS as u32, 1, 1),
            block: (256, 1, 1),
            shared_mem_bytes: bytes,
        };
        // SAFETY: shared_sum_u32(unsigned, unsigned long long*) matches; each block gets
        // `bytes` of dynamic shared memory, `words` u32s; `sums` holds one u64 per block.
        unsafe { kernel.launch(&stream, config, &args) }.unwrap();
        stream.synchronize().unwrap();
        let mut host = [0u64; BLOCKS];
        // SAFETY: `host` and `sums` hold BLOCKS u64s.
        unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), sums.ptr(), BLOCKS * 8) }
            .unwrap();
        let expected = u64::from(words) * u64::from(words - 1) / 2;
        assert_eq!(host, [expected; BLOCKS], "{bytes} bytes of shared memory");
    }
}

#[test]
fn impossible_launches_are_typed_errors_and_the_context_survives_them() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let test_kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let counts = zeroed_u32(context, 4096);
    let ptr = counts.ptr();
    let args = KernelArgs::new().arg(&ptr);
    let launch = |grid, block| {
        let config = LaunchConfig {
            grid,
            block,
            shared_mem_bytes: 0,
        };
        // SAFETY: count_threads_3d(unsigned*) matches; every launch tried here is either refused
        // before it runs or has at most 4096 threads, which `counts` covers.
        unsafe { kernels.count_threads_3d().launch(&stream, config, &args) }
    };
    // Refused by cuweave before the driver sees them.
    assert_invalid(launch((0, 1, 1), (32, 1, 1)), "an empty grid");
    assert_invalid(launch((1, 1, 0), (32, 1, 1)), "a grid of zero depth");
    assert_invalid(launch((1, 1, 1), (0, 1, 1)), "an empty block");
    assert_invalid(
        LaunchConfig::for_elements(100, 0),
        "for_elements with a block of 0",
    );
    assert_invalid(
        LaunchConfig::for_elements(100, 2048),
        "for_elements with 2048 threads",
    );
    // Refused by the driver.
    assert_driver_error(launch((1, 1, 1), (1025, 1, 1)), "a block of 1025 threads");
    assert_driver_error(
        launch((1, 1, 1), (32, 32, 2)),
        "a block of 2048 threads in 3-D",
    );
    assert_driver_error(launch((1, 1, 1), (1, 1, 65)), "a block deeper than 64");
    assert_driver_error(
        launch((1, 65_536, 1), (1, 1, 1)),
        "a grid taller than 65535",
    );
    // Nothing ran, and the context still runs work.
    assert_eq!(read_u32(&counts, 4096, &stream), vec![0; 4096]);
    launch((4, 1, 1), (1024, 1, 1)).unwrap();
    assert_eq!(read_u32(&counts, 4096, &stream), vec![1; 4096]);
    // SAFETY: `counts` holds 4096 u32s until the synchronize in `read_u32`.
    unsafe { test_kernels.fill_u32(&stream, counts.ptr(), 9, 4096) }.unwrap();
    assert_eq!(read_u32(&counts, 4096, &stream), vec![9; 4096]);
}

#[test]
fn arguments_of_every_size_and_a_struct_by_value_reach_the_kernel() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let out = DeviceAllocation::new(context, 8 * 8).unwrap();
    let ptr = out.ptr();
    let (a, b, c, d) = (0xa5u8, 0xbeefu16, 0xdead_beefu32, 0x0123_4567_89ab_cdefu64);
    let (e, f) = (1.5f32, -2.25f64);
    let g = Pair {
        first: u64::MAX - 1,
        second: 3.75,
    };
    let args = KernelArgs::new()
        .arg(&ptr)
        .arg(&a)
        .arg(&b)
        .arg(&c)
        .arg(&d)
        .arg(&e)
        .arg(&f)
        .arg(&g);
    assert_eq!(args.len(), 8);
    // SAFETY: echo_args(unsigned long long*, unsigned char, unsigned short, unsigned,
    // unsigned long long, float, double, Pair) matches, `Pair` is repr(C) like the kernel's
    // struct; `out` holds 8 u64s until the copy below.
    unsafe {
        kernels
            .echo_args()
            .launch(&stream, LaunchConfig::single(), &args)
    }
    .unwrap();
    stream.synchronize().unwrap();
    let mut host = [0u64; 8];
    // SAFETY: both hold 8 u64s.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), out.ptr(), 64) }.unwrap();
    assert_eq!(host, echoed(a, b, c, d, e, f, g));
}

#[test]
fn bad_modules_and_names_are_typed_errors_and_kernels_outlive_their_module_handle() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    assert_driver_error(
        Module::from_ptx(context, "this is not PTX at all"),
        "garbage PTX",
    );
    assert_driver_error(
        Module::from_ptx(
            context,
            ".version 8.0\n.target sm_75\n.address_size 64\n.visible .entry broken( {",
        ),
        "truncated PTX",
    );
    assert_invalid(
        Module::from_ptx(context, ".version 8.0\0"),
        "PTX with a NUL byte",
    );
    assert_invalid(Module::from_cubin(context, &[]), "an empty image");
    assert_invalid(
        Module::from_cubin(context, b"\x7fELF\x02\x01"),
        "a truncated ELF",
    );

    let module = Module::from_ptx(context, cuweave_test_support::launch_kernels::PTX).unwrap();
    match module.function("no_such_kernel") {
        Err(error) => assert_eq!(
            error.code(),
            Some(sys::CUresult::CUDA_ERROR_NOT_FOUND),
            "{error}"
        ),
        Ok(kernel) => panic!("found a kernel that does not exist: {kernel:?}"),
    }
    assert_invalid(module.function("echo\0args"), "a name with a NUL byte");
    // A mangled or differently-cased name is not the extern "C" one.
    assert!(module.function("Echo_Args").is_err());

    // cudarc's pattern: keep the function, drop the module handle, launch later.
    let kernel: Kernel = module.function("count_threads_3d").unwrap();
    assert_eq!(kernel.name(), "count_threads_3d");
    drop(module);
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let counts = zeroed_u32(context, 64);
    let ptr = counts.ptr();
    let args = KernelArgs::new().arg(&ptr);
    // SAFETY: count_threads_3d(unsigned*) matches; 64 threads, 64 counters.
    unsafe { kernel.launch(&stream, LaunchConfig::for_elements(64, 64).unwrap(), &args) }.unwrap();
    assert_eq!(read_u32(&counts, 64, &stream), vec![1; 64]);
}

#[test]
fn module_globals_are_set_before_a_launch_and_read_after_it() {
    use cuweave_test_support::launch_kernels::{SCALE_LAUNCHES, SCALE_TABLE};
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let module = kernels.module();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let (table, table_bytes) = module.global(SCALE_TABLE).unwrap();
    let (launches, launches_bytes) = module.global(SCALE_LAUNCHES).unwrap();
    assert_eq!((table_bytes, launches_bytes), (16, 8));
    let factors = [1u32, 2, 3, 5];
    // SAFETY: the table holds 4 u32s; no kernel reads it yet.
    unsafe { memory::copy_htod(context, table, factors.as_ptr().cast(), 16) }.unwrap();
    const N: usize = 10_000;
    let data = DeviceAllocation::new(context, N * 4).unwrap();
    // SAFETY: `data` holds N u32s.
    unsafe { memory::memset_d32(context, data.ptr(), 10, N) }.unwrap();
    let (ptr, n) = (data.ptr(), N as u64);
    let args = KernelArgs::new().arg(&ptr).arg(&n);
    for _ in 0..2 {
        // SAFETY: scale_by_table_u32(unsigned*, size_t) matches; `data` holds N u32s and the
        // module's globals live while `kernels` does.
        unsafe {
            kernels.scale_by_table_u32().launch(
                &stream,
                LaunchConfig::for_elements(N, 256).unwrap(),
                &args,
            )
        }
        .unwrap();
    }
    let seen = read_u32(&data, N, &stream);
    for (i, &value) in seen.iter().enumerate() {
        let factor = factors[i % 4];
        assert_eq!(value, 10 * factor * factor, "element {i}");
    }
    let mut count = 0u64;
    // SAFETY: the counter is one u64.
    unsafe { memory::copy_dtoh(context, (&mut count as *mut u64).cast(), launches, 8) }.unwrap();
    assert_eq!(count, 2);
    match module.global("no_such_global") {
        Err(error) => assert_eq!(error.code(), Some(sys::CUresult::CUDA_ERROR_NOT_FOUND)),
        Ok(found) => panic!("found a global that does not exist: {found:?}"),
    }
    assert_invalid(module.global("scale\0table"), "a name with a NUL byte");
}

#[test]
fn occupancy_queries_give_shapes_that_launch() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = LaunchKernels::load(context).unwrap();
    let kernel = kernels.count_threads_3d();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let (grid, block) = kernel.max_potential_block_size(0, 0).unwrap();
    assert!(grid >= 1, "{grid}");
    assert!((32..=1024).contains(&block) && block % 32 == 0, "{block}");
    let resident = kernel
        .max_active_blocks_per_multiprocessor(block, 0)
        .unwrap();
    assert!(resident >= 1, "{resident} blocks of {block}");
    let sms = gpu.device.capabilities().unwrap().multiprocessor_count;
    assert!(
        grid <= resident * sms,
        "grid {grid} for {sms} SMs of {resident}"
    );
    let (_, limited) = kernel.max_potential_block_size(0, 64).unwrap();
    assert!((1..=64).contains(&limited), "{limited}");
    assert_invalid(
        kernel.max_active_blocks_per_multiprocessor(0, 0),
        "occupancy of an empty block",
    );
    // The suggested shape runs every thread once.
    let threads = (grid * block) as usize;
    let counts = zeroed_u32(context, threads);
    let ptr = counts.ptr();
    let args = KernelArgs::new().arg(&ptr);
    let config = LaunchConfig {
        grid: (grid, 1, 1),
        block: (block, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: count_threads_3d(unsigned*) matches; `counts` holds a u32 per thread.
    unsafe { kernel.launch(&stream, config, &args) }.unwrap();
    assert!(read_u32(&counts, threads, &stream).iter().all(|&c| c == 1));
    // With dynamic shared memory fewer blocks fit, never more.
    let shared = kernels
        .shared_sum_u32()
        .max_active_blocks_per_multiprocessor(128, 48 * 1024)
        .unwrap();
    assert!(shared >= 1, "{shared}");
    assert!(
        shared
            <= kernels
                .shared_sum_u32()
                .max_active_blocks_per_multiprocessor(128, 0)
                .unwrap()
    );
}

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------

#[test]
fn pooled_timing_events_time_a_spinning_kernel_plausibly() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&stream, 0).unwrap();
    stream.synchronize().unwrap();
    let pool = EventPool::for_context(context).unwrap();
    let start = pool.acquire_event(true).unwrap();
    let end = pool.acquire_event(true).unwrap();
    assert!(start.is_timing() && end.flags().is_timing());
    start.record(&stream).unwrap();
    kernels.spin_ns(&stream, 3 * MS).unwrap();
    end.record(&stream).unwrap();
    // Pending: the elapsed time is not there yet, and saying so is not a failure.
    match start.elapsed_ms(&end) {
        Err(error) => assert!(error.is_not_ready(), "{error}"),
        // Only possible if the 3 ms passed in between (a preempted test thread).
        Ok(ms) => assert!(
            end.query().unwrap(),
            "{ms} ms before the end event completed"
        ),
    }
    end.synchronize().unwrap();
    assert!(end.query().unwrap() && start.query().unwrap());
    let ms = start.elapsed_ms(&end).unwrap();
    assert!((2.9..1000.0).contains(&ms), "a 3 ms spin timed as {ms} ms");

    // Events never recorded have no timestamps: the driver's error, not a panic.
    let (a, b) = (
        Event::new(context, EventFlags::TIMING).unwrap(),
        Event::new(context, EventFlags::TIMING).unwrap(),
    );
    assert!(
        a.query().unwrap(),
        "a never-recorded event counts as complete"
    );
    assert!(a.elapsed_ms(&b).is_err());
    // And a non-timing pooled event is refused before the driver.
    let plain = pool.acquire_event(false).unwrap();
    plain.record(&stream).unwrap();
    assert_invalid(
        start.elapsed_ms(&plain),
        "elapsed time to a non-timing event",
    );
}

#[test]
fn a_consumer_stream_waits_on_events_of_two_producers_proven_by_bytes() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let pool = EventPool::for_context(context).unwrap();
    let producers = [
        Stream::new(context, StreamFlags::NON_BLOCKING).unwrap(),
        Stream::new(context, StreamFlags::NON_BLOCKING).unwrap(),
    ];
    let consumer = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const N: usize = 1 << 16;
    let data = zeroed_u32(context, 2 * N);
    let sum = DeviceAllocation::new(context, 8).unwrap();
    // SAFETY: `sum` holds one u64.
    unsafe { memory::memset_d8(context, sum.ptr(), 0, 8) }.unwrap();
    let mut done = Vec::new();
    for (half, producer) in producers.iter().enumerate() {
        // The producers are slow: without the waits the consumer would read zeros.
        kernels.spin_ns(producer, 20 * MS).unwrap();
        // SAFETY: each half holds N u32s; all work finishes before `data` drops.
        unsafe { kernels.fill_u32(producer, data.ptr() + (half * N * 4) as u64, 3, N) }.unwrap();
        let event = pool.acquire_owned(false).unwrap();
        event.record(producer).unwrap();
        done.push(event);
    }
    for event in &done {
        consumer.wait_event(event).unwrap();
    }
    // The events go back to the pool at once; the waits already queued are unaffected.
    drop(done);
    // SAFETY: `data` holds 2N u32s, `sum` one u64; synchronised below.
    unsafe { kernels.checksum_u32(&consumer, data.ptr(), 2 * N, sum.ptr()) }.unwrap();
    assert!(
        !consumer.query().unwrap(),
        "the consumer ran ahead of 20 ms producers"
    );
    consumer.synchronize().unwrap();
    let mut total = 0u64;
    // SAFETY: one u64 each.
    unsafe { memory::copy_dtoh(context, (&mut total as *mut u64).cast(), sum.ptr(), 8) }.unwrap();
    assert_eq!(total, 3 * 2 * N as u64);
}

#[test]
fn an_event_pool_shared_by_eight_threads_over_100k_acquisitions_stays_bounded() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let pool = EventPool::new(context, 0, 0).unwrap();
    const THREADS: usize = 8;
    const ROUNDS: usize = 12_500;
    // Plain threads, joined: a join returns after the thread's thread-local destructors ran
    // (which hand its cached event back), unlike the end of a thread scope.
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let pool = pool.clone();
            std::thread::spawn(move || {
                let stream = Stream::new(pool.context(), StreamFlags::NON_BLOCKING).unwrap();
                for round in 0..ROUNDS {
                    let event = pool.acquire_event(round % 2 == 0).unwrap();
                    if round % 500 == 0 {
                        event.record(&stream).unwrap();
                        event.synchronize().unwrap();
                    }
                    if round % 7 == 0 {
                        // Two at once now and then, one of them owned.
                        let owned = pool.acquire_owned(false).unwrap();
                        owned.record(&stream).unwrap();
                    }
                }
                stream.synchronize().unwrap();
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let counters = pool.counters();
    let created = counters.created_regular + counters.created_timing + counters.created_blocking;
    assert!(
        created <= 8 * THREADS as u64,
        "{created} events made for {THREADS} threads holding at most two each: {counters:?}"
    );
    let utilization = pool.utilization();
    assert_eq!(utilization.in_use, 0, "{utilization:?}");
    // The events are reused, not leaked: one more round on this thread makes none.
    let before = pool.counters();
    for _ in 0..1000 {
        drop(pool.acquire_event(false).unwrap());
        drop(pool.acquire_event(true).unwrap());
    }
    assert_eq!(pool.counters().grown, before.grown);
}

#[test]
fn owned_pooled_events_and_plain_events_move_to_other_threads() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let pool = EventPool::for_context(context).unwrap();
    assert!(
        pool.acquire_event(false)
            .unwrap()
            .belongs_to(&EventPool::for_context(context).unwrap())
    );
    kernels.spin_ns(&stream, 10 * MS).unwrap();
    let owned = pool.acquire_owned(false).unwrap();
    owned.record(&stream).unwrap();
    let plain = Event::new(context, EventFlags::DISABLE_TIMING.with_blocking_sync()).unwrap();
    plain.record(&stream).unwrap();
    drop(pool);
    let (tx, rx) = mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // A fresh thread with no current context.
        assert!(Context::current_raw().unwrap().is_null());
        owned.synchronize().unwrap();
        plain.synchronize().unwrap();
        tx.send((owned.query().unwrap(), plain.query().unwrap()))
            .unwrap();
        // The owned event goes back to its pool here, which it keeps alive.
    });
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(10)).unwrap(),
        (true, true)
    );
    waiter.join().unwrap();
    assert!(stream.query().unwrap());
}

// ---------------------------------------------------------------------------------------------
// Streams
// ---------------------------------------------------------------------------------------------

#[test]
fn every_priority_of_the_range_makes_a_working_stream() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let range = context.stream_priority_range().unwrap();
    assert!(range.greatest <= range.least, "{range:?}");
    let data = zeroed_u32(context, 1024);
    for priority in range.greatest..=range.least {
        for flags in [StreamFlags::DEFAULT, StreamFlags::NON_BLOCKING] {
            let stream = Stream::with_priority(context, flags, priority).unwrap();
            assert_eq!(stream.priority().unwrap(), priority);
            assert_eq!(stream.flags().unwrap(), flags);
            // SAFETY: `data` holds 1024 u32s; synchronised in `read_u32`.
            unsafe { kernels.increment_u32(&stream, data.ptr(), 1024) }.unwrap();
            stream.synchronize().unwrap();
        }
    }
    let launches = 2 * (range.least - range.greatest + 1) as u32;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    assert_eq!(read_u32(&data, 1024, &stream), vec![launches; 1024]);
}

#[test]
fn a_stream_is_busy_while_a_kernel_spins_and_its_host_functions_run_once_in_order() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let mut word = HostAllocation::new(context, 4096, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    word.as_bytes_mut()[..4].copy_from_slice(&0u32.to_ne_bytes());
    let flag = word.device_ptr().unwrap();
    // SAFETY: the first 4 bytes of the page are a 4-aligned u32 that only the device writes
    // while this test reads it atomically; the page outlives the synchronize below.
    let seen = unsafe { &*(word.as_ptr() as *const AtomicU32) };
    let order = Arc::new(Mutex::new(Vec::new()));
    let runs = Arc::new(AtomicUsize::new(0));
    for step in 1..=3u32 {
        // SAFETY: `flag` is the mapped u32 above.
        unsafe { kernels.spin_then_store_u32(&stream, 5 * MS, flag, step) }.unwrap();
        let (order, runs) = (Arc::clone(&order), Arc::clone(&runs));
        let seen_at_callback = word.as_ptr() as usize;
        stream
            .launch_host_fn(move || {
                // SAFETY: the page lives until the stream has synchronised, after this runs.
                let seen = unsafe { &*(seen_at_callback as *const AtomicU32) };
                order
                    .lock()
                    .unwrap()
                    .push((step, seen.load(Ordering::Acquire)));
                runs.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
    }
    assert!(!stream.query().unwrap(), "15 ms of spinning already done");
    stream.synchronize().unwrap();
    assert!(stream.query().unwrap());
    assert_eq!(seen.load(Ordering::Acquire), 3);
    assert_eq!(
        runs.load(Ordering::Relaxed),
        3,
        "each host function runs once"
    );
    // Each callback saw the store of the kernel before it: in order with the stream's work.
    assert_eq!(*order.lock().unwrap(), vec![(1, 1), (2, 2), (3, 3)]);
    // The closures are freed once run: only our handles remain.
    assert_eq!(Arc::strong_count(&order), 1);
    assert_eq!(Arc::strong_count(&runs), 1);
}

#[test]
fn host_functions_from_many_threads_each_run_once_and_are_freed() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let runs = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|scope| {
        for _ in 0..8 {
            let runs = Arc::clone(&runs);
            scope.spawn(move || {
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                for _ in 0..200 {
                    let runs = Arc::clone(&runs);
                    stream
                        .launch_host_fn(move || {
                            runs.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap();
                }
                stream.synchronize().unwrap();
            });
        }
    });
    assert_eq!(runs.load(Ordering::Relaxed), 1600);
    assert_eq!(Arc::strong_count(&runs), 1, "a closure was leaked");
}

#[test]
fn dropping_a_stream_with_queued_work_returns_at_once_and_the_work_still_completes() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let word = HostAllocation::new(context, 4096, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    let flag = word.device_ptr().unwrap();
    // SAFETY: as in the test above: a mapped u32 only the device writes while we read it.
    let seen = unsafe { &*(word.as_ptr() as *const AtomicU32) };
    let _serial = cuweave_test_support::serial();
    let callback_ran = Arc::new(AtomicUsize::new(0));
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&stream, 0).unwrap();
    // SAFETY: as below; synchronised at once.
    unsafe { kernels.spin_then_store_u32(&stream, 0, flag, 1) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(seen.load(Ordering::Acquire), 1);
    {
        kernels.spin_ns(&stream, 200 * MS).unwrap();
        // SAFETY: `flag` is the mapped u32 above; the page outlives the kernel (we wait for
        // the store before dropping it).
        unsafe { kernels.spin_then_store_u32(&stream, 0, flag, 42) }.unwrap();
        let callback_ran = Arc::clone(&callback_ran);
        stream
            .launch_host_fn(move || {
                callback_ran.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        drop(stream);
    }
    // The drop did not wait for the 200 ms of work queued before the store.
    assert_eq!(
        seen.load(Ordering::Acquire),
        1,
        "dropping the stream waited for its work"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while (seen.load(Ordering::Acquire) != 42 || Arc::strong_count(&callback_ran) != 1)
        && Instant::now() < deadline
    {
        std::thread::yield_now();
    }
    assert_eq!(
        seen.load(Ordering::Acquire),
        42,
        "the queued kernel never ran"
    );
    assert_eq!(callback_ran.load(Ordering::Relaxed), 1);
    assert_eq!(
        Arc::strong_count(&callback_ran),
        1,
        "the queued closure was leaked"
    );
}

#[test]
fn the_legacy_default_stream_orders_after_blocking_streams_and_works_from_any_thread() {
    let gpu = require_gpu!();
    let context = Arc::clone(&gpu.context);
    let kernels = TestKernels::load(&context).unwrap();
    const N: usize = 4096;
    let data = zeroed_u32(&context, N);
    let ptr = data.ptr();
    std::thread::spawn(move || {
        // cudarc's `default_stream()`, used from a thread with no current context.
        assert!(Context::current_raw().unwrap().is_null());
        let legacy = Stream::legacy_default(&context);
        assert!(legacy.as_raw().is_null());
        assert!(!legacy.is_capturing().unwrap());
        assert_eq!(
            legacy.capture_status().unwrap(),
            cuweave_driver::CaptureStatus::None
        );
        match legacy.begin_capture(CaptureMode::ThreadLocal) {
            Err(DriverError::Graph(GraphError::LegacyDefaultStream { .. })) => {}
            other => panic!("capturing the legacy stream gave {other:?}"),
        }
        // A blocking stream's slow fill, then an increment on the legacy stream: the legacy
        // stream waits for it, so every element ends at 2 (1 if the increment ran first).
        let blocking = Stream::new(&context, StreamFlags::DEFAULT).unwrap();
        kernels.spin_ns(&blocking, 20 * MS).unwrap();
        // SAFETY: `data` holds N u32s and outlives this thread's synchronize.
        unsafe { kernels.fill_u32(&blocking, ptr, 1, N) }.unwrap();
        // SAFETY: as above.
        unsafe { kernels.increment_u32(&legacy, ptr, N) }.unwrap();
        let done = Event::new(&context, EventFlags::DISABLE_TIMING).unwrap();
        done.record(&legacy).unwrap();
        assert!(
            !legacy.query().unwrap(),
            "the legacy stream ran ahead of 20 ms of work"
        );
        let ran = Arc::new(AtomicUsize::new(0));
        let ran_in_callback = Arc::clone(&ran);
        legacy
            .launch_host_fn(move || {
                ran_in_callback.fetch_add(1, Ordering::Relaxed);
            })
            .unwrap();
        legacy.synchronize().unwrap();
        assert!(done.query().unwrap() && blocking.query().unwrap());
        assert_eq!(ran.load(Ordering::Relaxed), 1);
    })
    .join()
    .unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    assert_eq!(read_u32(&data, N, &stream), vec![2; N]);
}

// ---------------------------------------------------------------------------------------------
// Devices and contexts
// ---------------------------------------------------------------------------------------------

#[test]
fn every_device_reports_its_properties_and_capabilities() {
    let _gpu = require_gpu!();
    let devices = Device::all().unwrap();
    assert_eq!(devices.len(), Device::count().unwrap());
    for device in devices {
        let name = device.name().unwrap();
        assert!(!name.is_empty());
        let bus = device.pci_bus_id().unwrap();
        assert!(bus.contains(':'), "bus id {bus}");
        let total = device.total_memory().unwrap();
        assert!(total >= 1 << 30, "{name}: {total} bytes");
        let capability = device.compute_capability().unwrap();
        assert!(capability.major >= 5, "{name}: {capability}");
        let caps = device.capabilities().unwrap();
        assert!(caps.multiprocessor_count > 0);
        assert!(caps.unified_addressing, "every 64-bit driver has UVA");
        assert!(caps.can_map_host_memory);
        assert!(caps.managed_memory);
        assert_eq!(
            device.managed_support().unwrap().managed_memory,
            caps.managed_memory
        );
        assert!(device.async_engine_count().unwrap() >= 1);
        use sys::CUdevice_attribute as A;
        for attribute in [
            A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
            A::CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X,
            A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X,
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK,
            A::CU_DEVICE_ATTRIBUTE_WARP_SIZE,
            A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
        ] {
            assert!(
                device.attribute(attribute).unwrap() > 0,
                "{name}: {attribute:?}"
            );
        }
        assert_eq!(
            device.attribute(A::CU_DEVICE_ATTRIBUTE_WARP_SIZE).unwrap(),
            32
        );
        assert_eq!(
            device
                .attribute(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)
                .unwrap(),
            LaunchConfig::MAX_BLOCK_THREADS as i32
        );
        assert_eq!(Device::from_raw(device.as_raw()).unwrap(), device);
        assert!(!device.can_access_peer(&device).unwrap());
    }
    let count = Device::count().unwrap();
    assert_invalid(Device::get(count), "an ordinal past the last device");
    assert_invalid(Device::get(usize::MAX), "ordinal usize::MAX");
    assert_invalid(Device::from_raw(-1), "a negative device handle");
}

#[test]
fn primary_context_handles_made_and_dropped_on_many_threads_keep_it_alive_and_shared() {
    let gpu = require_gpu!();
    let device = gpu.device;
    let primary = gpu.context.as_raw() as usize;
    std::thread::scope(|scope| {
        for _ in 0..8 {
            scope.spawn(move || {
                for _ in 0..50 {
                    let context = Context::primary(device).unwrap();
                    assert_eq!(context.as_raw() as usize, primary, "one primary context");
                    let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).unwrap();
                    stream.synchronize().unwrap();
                    drop(stream);
                    drop(context);
                }
            });
        }
    });
    assert!(device.primary_context_active().unwrap());
    // The test's own handle still works: the 400 releases matched the 400 retains.
    let info = gpu.context.memory_info().unwrap();
    assert!(info.free > 0 && info.free <= info.total);
    let buffer = zeroed_u32(&gpu.context, 256);
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    assert_eq!(read_u32(&buffer, 256, &stream), vec![0; 256]);
}

#[test]
fn handles_made_on_one_thread_are_used_on_another_with_no_current_context() {
    let gpu = require_gpu!();
    let context = Arc::clone(&gpu.context);
    let kernels = TestKernels::load(&context).unwrap();
    let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).unwrap();
    let event = Event::new(&context, EventFlags::DISABLE_TIMING).unwrap();
    let buffer = zeroed_u32(&context, 4096);
    let buffer = std::thread::spawn(move || {
        assert!(Context::current_raw().unwrap().is_null());
        // SAFETY: `buffer` holds 4096 u32s and moves with the kernel's stream.
        unsafe { kernels.fill_u32(&stream, buffer.ptr(), 0x5eed, 4096) }.unwrap();
        event.record(&stream).unwrap();
        event.synchronize().unwrap();
        (buffer, stream)
    })
    .join()
    .unwrap();
    assert_eq!(read_u32(&buffer.0, 4096, &buffer.1), vec![0x5eed; 4096]);
}

#[test]
fn raw_handles_round_trip_for_interop() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();

    // A context borrowed from "another library" (here: ours) makes working handles and is
    // not released when dropped.
    // SAFETY: the primary context is live and outlives the borrowed handle (gpu holds it).
    let borrowed = unsafe { Context::from_raw_borrowed(context.as_raw(), gpu.device) };
    assert_eq!(borrowed.as_raw(), context.as_raw());
    let stream = Stream::new(&borrowed, StreamFlags::NON_BLOCKING).unwrap();
    drop(borrowed);

    // A stream wrapped without ownership queues on the same queue and is not destroyed by drop.
    // SAFETY: `stream` is live and outlives the wrapper.
    let wrapped = unsafe { Stream::from_raw(context, stream.as_raw(), false) };
    assert_eq!(wrapped.as_raw(), stream.as_raw());
    assert_ne!(wrapped.id(), stream.id());
    let buffer = zeroed_u32(context, 1024);
    kernels.spin_ns(&wrapped, 20 * MS).unwrap();
    // SAFETY: 1024 u32s, synchronised in `read_u32`.
    unsafe { kernels.increment_u32(&wrapped, buffer.ptr(), 1024) }.unwrap();
    drop(wrapped);
    assert!(
        !stream.query().unwrap(),
        "the wrapped work is on the original stream"
    );
    assert_eq!(read_u32(&buffer, 1024, &stream), vec![1; 1024]);

    // An event wrapped without ownership.
    let event = Event::new(context, EventFlags::TIMING).unwrap();
    // SAFETY: live event of `context`, created with these flags, outliving the wrapper.
    let alias = unsafe { Event::from_raw(context, event.as_raw(), EventFlags::TIMING, false) };
    alias.record(&stream).unwrap();
    drop(alias);
    event.synchronize().unwrap();
    assert!(event.query().unwrap());

    // Device memory handed out and taken back.
    let (ptr, bytes) = buffer.into_raw();
    // SAFETY: `ptr` came from cuMemAlloc in `context` with `bytes`, and we own it again.
    let buffer = unsafe { DeviceAllocation::from_raw(context, ptr, bytes) };
    assert_eq!(read_u32(&buffer, 1024, &stream), vec![1; 1024]);
    buffer.free().unwrap();

    // A module and kernel wrapped from raw handles.
    let module = kernels.module();
    // SAFETY: `module` is live and outlives the unowned wrapper and its kernels.
    let alias = unsafe { Module::from_raw(context, module.as_raw(), false) };
    let fill = alias.function("fill_u32").unwrap();
    // SAFETY: the CUfunction belongs to `alias`'s module.
    let fill = unsafe { Kernel::from_raw(&alias, fill.as_raw(), "fill_u32") };
    let out = zeroed_u32(context, 256);
    let (dst, value, n) = (out.ptr(), 77u32, 256u64);
    let args = KernelArgs::new().arg(&dst).arg(&value).arg(&n);
    // SAFETY: fill_u32(unsigned*, unsigned, size_t) matches; `out` holds 256 u32s.
    unsafe {
        fill.launch(
            &stream,
            LaunchConfig::for_elements(256, 128).unwrap(),
            &args,
        )
    }
    .unwrap();
    assert_eq!(read_u32(&out, 256, &stream), vec![77; 256]);
}

// ---------------------------------------------------------------------------------------------
// Raw memory
// ---------------------------------------------------------------------------------------------

fn pattern(bytes: usize, seed: u8) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

#[test]
fn sync_and_async_copies_and_memsets_round_trip_byte_for_byte() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    for bytes in [1usize, 3, 4096, 65_537, 3 * MIB + 5] {
        let source = pattern(bytes, bytes as u8);
        let a = DeviceAllocation::new(context, bytes).unwrap();
        // SAFETY: `source` and `a` hold `bytes`.
        unsafe { memory::copy_htod(context, a.ptr(), source.as_ptr(), bytes) }.unwrap();
        // Stream-ordered allocation, device-to-device async, back through pinned memory.
        // SAFETY: freed below with free_async on the same stream.
        let b = unsafe { memory::alloc_async(&stream, bytes) }.unwrap();
        let mut pinned = HostAllocation::new(context, bytes, HostAllocFlags::default()).unwrap();
        // SAFETY: every range holds `bytes` and lives until the synchronize.
        unsafe {
            memory::copy_dtod_async(b, a.ptr(), bytes, &stream).unwrap();
            memory::copy_dtoh_async(pinned.as_mut_ptr(), b, bytes, &stream).unwrap();
            memory::free_async(b, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        assert!(
            pinned.as_bytes() == source.as_slice(),
            "{bytes} bytes via stream order"
        );
        // Unified-address copies, both ways, and a synchronous device-to-host.
        let c = DeviceAllocation::new(context, bytes).unwrap();
        // SAFETY: pinned and `c` hold `bytes`.
        unsafe { memory::copy(context, c.ptr(), pinned.as_ptr() as u64, bytes) }.unwrap();
        let mut back = vec![0u8; bytes];
        // SAFETY: `back` and `c` hold `bytes`.
        unsafe { memory::copy_dtoh(context, back.as_mut_ptr(), c.ptr(), bytes) }.unwrap();
        assert!(back == source, "{bytes} bytes via cuMemcpy");
        // A pageable async upload returns with `source` read; then a synchronous dtod.
        // SAFETY: `source` lives until the synchronize; both ranges hold `bytes`.
        unsafe {
            memory::copy_htod_async(c.ptr(), source.as_ptr(), bytes, &stream).unwrap();
        }
        stream.synchronize().unwrap();
        // SAFETY: both hold `bytes`.
        unsafe { memory::copy_dtod(context, a.ptr(), c.ptr(), bytes) }.unwrap();
        let mut back = vec![0u8; bytes];
        // SAFETY: as above.
        unsafe { memory::copy_dtoh(context, back.as_mut_ptr(), a.ptr(), bytes) }.unwrap();
        assert!(back == source, "{bytes} bytes via pageable async then dtod");

        // Memsets: a byte value over everything, then a stream-ordered byte value over an inner
        // range; 32-bit words checked separately below.
        // SAFETY: `a` holds `bytes`.
        unsafe { memory::memset_d8(context, a.ptr(), 0xab, bytes) }.unwrap();
        let inner = bytes / 3..bytes - bytes / 3;
        // SAFETY: `inner` lies inside `a`.
        unsafe {
            memory::memset_d8_async(a.ptr() + inner.start as u64, 0x11, inner.len(), &stream)
                .unwrap();
        }
        stream.synchronize().unwrap();
        // SAFETY: as above.
        unsafe { memory::copy_dtoh(context, back.as_mut_ptr(), a.ptr(), bytes) }.unwrap();
        for (i, &byte) in back.iter().enumerate() {
            let expected = if inner.contains(&i) { 0x11 } else { 0xab };
            assert_eq!(byte, expected, "{bytes} bytes: byte {i}");
        }
    }
    let words = DeviceAllocation::new(context, 4096 * 4).unwrap();
    // SAFETY: `words` holds 4096 u32s, 4-aligned.
    unsafe {
        memory::memset_d32(context, words.ptr(), 0xdead_beef, 4096).unwrap();
        memory::memset_d32_async(words.ptr() + 4, 7, 4094, &stream).unwrap();
    }
    let seen = read_u32(&words, 4096, &stream);
    assert_eq!(seen[0], 0xdead_beef);
    assert_eq!(seen[4095], 0xdead_beef);
    assert!(seen[1..4095].iter().all(|&w| w == 7));
}

#[test]
fn pointer_attributes_name_every_kind_of_memory() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let device = DeviceAllocation::new(context, MIB).unwrap();
    let attributes = memory::pointer_attributes(device.ptr() + 100).unwrap();
    assert_eq!(
        (
            attributes.memory_type,
            attributes.device_ordinal,
            attributes.is_managed
        ),
        (MemoryType::Device, 0, false)
    );
    let pinned = HostAllocation::new(context, MIB, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    let attributes = memory::pointer_attributes(pinned.as_ptr() as u64).unwrap();
    assert_eq!(attributes.memory_type, MemoryType::Host);
    assert!(!attributes.is_managed);
    // The mapped device address of pinned memory is the same memory.
    let mapped = memory::pointer_attributes(pinned.device_ptr().unwrap()).unwrap();
    assert_eq!(mapped.memory_type, MemoryType::Host);
    let managed = ManagedAllocation::new(context, MIB).unwrap();
    let attributes = memory::pointer_attributes(managed.ptr()).unwrap();
    assert!(attributes.is_managed);
    // SAFETY: freed below on the same stream.
    let ordered = unsafe { memory::alloc_async(&stream, MIB) }.unwrap();
    stream.synchronize().unwrap();
    let attributes = memory::pointer_attributes(ordered).unwrap();
    assert_eq!(
        (attributes.memory_type, attributes.is_managed),
        (MemoryType::Device, false)
    );
    assert_eq!(
        memory::address_range(context, device.ptr() + 5).unwrap(),
        (device.ptr(), MIB)
    );
    // SAFETY: `ordered` is a live stream-ordered allocation, freed once.
    unsafe { memory::free_async(ordered, &stream) }.unwrap();
    stream.synchronize().unwrap();
    // Registered pageable memory is host memory too, and goes back unregistered.
    let mut pageable = vec![0u8; 2 * MIB];
    let registration = memory::HostRegistration::new(context, &mut pageable).unwrap();
    let attributes = memory::pointer_attributes(registration.as_ptr() as u64).unwrap();
    assert_eq!(attributes.memory_type, MemoryType::Host);
    let slice = registration.unregister().unwrap();
    assert_eq!(slice.len(), 2 * MIB);
}

#[test]
fn memory_info_and_pools_account_for_what_is_allocated_and_freed() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    const BIG: usize = 1 << 30;
    let before = context.memory_info().unwrap();
    if before.free < 4 * BIG {
        cuweave_test_support::skip(
            "memory_info_and_pools_account_for_what_is_allocated_and_freed",
            "less than 4 GiB free",
        );
        return;
    }
    let big = DeviceAllocation::new(context, BIG).unwrap();
    let during = context.memory_info().unwrap();
    assert_eq!(during.total, before.total);
    assert!(
        during.free + BIG / 2 <= before.free,
        "1 GiB allocated, free went from {} to {}",
        before.free,
        during.free
    );
    big.free().unwrap();
    let after = context.memory_info().unwrap();
    assert!(
        after.free + BIG / 2 > before.free,
        "1 GiB freed, free went from {} to {}",
        before.free,
        after.free
    );

    let device = gpu.device;
    if !device.supports_memory_pools().unwrap() {
        return;
    }
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let pool = MemoryPool::new(context).unwrap();
    pool.set_release_threshold(u64::MAX).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX);
    let mut held = Vec::new();
    for bytes in [MIB, 3 * MIB, 17 * MIB] {
        // SAFETY: each is freed below on the same stream.
        held.push(unsafe { pool.alloc_async(bytes, &stream) }.unwrap());
    }
    stream.synchronize().unwrap();
    assert!(pool.used_bytes().unwrap() >= 21 * MIB as u64);
    for ptr in held {
        // SAFETY: live allocations from the pool, freed once.
        unsafe { memory::free_async(ptr, &stream) }.unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(pool.used_bytes().unwrap(), 0);
    assert!(
        pool.reserved_bytes().unwrap() >= 21 * MIB as u64,
        "kept under the threshold"
    );
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0);
}

#[test]
fn bad_sizes_and_addresses_are_typed_errors() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    assert_invalid(DeviceAllocation::new(context, 0), "a zero-byte allocation");
    assert_invalid(
        HostAllocation::new(context, 0, HostAllocFlags::default()),
        "zero pinned bytes",
    );
    assert_invalid(ManagedAllocation::new(context, 0), "zero managed bytes");
    // SAFETY: refused before the driver.
    assert_invalid(
        unsafe { memory::alloc_async(&stream, 0) },
        "a zero-byte async allocation",
    );
    match DeviceAllocation::new(context, usize::MAX / 2) {
        Err(error) => assert!(error.code().is_some(), "{error}"),
        Ok(allocation) => panic!("allocated {} bytes", allocation.len()),
    }
    let unmapped = HostAllocation::new(context, 4096, HostAllocFlags::default()).unwrap();
    assert_invalid(
        unmapped.device_ptr(),
        "the device address of unmapped pinned memory",
    );
    // The context is fine after the refusals.
    let buffer = zeroed_u32(context, 16);
    assert_eq!(read_u32(&buffer, 16, &stream), vec![0; 16]);
}

// ---------------------------------------------------------------------------------------------
// Graphs and completion words
// ---------------------------------------------------------------------------------------------

#[test]
fn a_captured_graph_is_uploaded_launched_many_times_and_updated_with_a_new_capture() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const N: usize = 1 << 14;
    let first = zeroed_u32(context, N);
    let second = zeroed_u32(context, N);
    let capture = |target: &DeviceAllocation, times: usize| {
        stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
        assert!(stream.is_capturing().unwrap());
        for _ in 0..times {
            // SAFETY: `target` holds N u32s and outlives every launch (the test synchronises
            // before dropping it).
            unsafe { kernels.increment_u32(&stream, target.ptr(), N) }.unwrap();
        }
        stream.end_capture().unwrap()
    };
    let graph = capture(&first, 2);
    assert_eq!(graph.node_count().unwrap(), 2);
    let mut exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    exec.upload(&stream).unwrap();
    for _ in 0..100 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(exec.launch_count(), 100);
    assert_eq!(read_u32(&first, N, &stream), vec![200; N]);

    // The same code captured again on another buffer: same shape, new address.
    let again = capture(&second, 2);
    exec.update(&again).unwrap();
    for _ in 0..5 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(read_u32(&second, N, &stream), vec![10; N]);
    assert_eq!(
        read_u32(&first, N, &stream),
        vec![200; N],
        "the old target was left alone"
    );

    // Another shape is refused and leaves the executable as it was.
    let other = capture(&first, 3);
    match exec.update(&other) {
        Err(DriverError::Graph(GraphError::UpdateRejected { .. })) => {}
        outcome => panic!("an update with another topology gave {outcome:?}"),
    }
    exec.launch(&stream).unwrap();
    assert_eq!(read_u32(&second, N, &stream), vec![12; N]);

    // Completion words see a graph's work done without a stream synchronisation.
    let words = CompletionWords::new(context).unwrap();
    kernels.spin_ns(&stream, 5 * MS).unwrap();
    exec.launch(&stream).unwrap();
    words.synchronize(&stream).unwrap();
    assert!(stream.query().unwrap());
    let mut host = vec![0u32; N];
    // SAFETY: `host` and `second` hold N u32s.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr().cast(), second.ptr(), N * 4) }.unwrap();
    assert_eq!(host, vec![14; N]);
}

// ---------------------------------------------------------------------------------------------
// No driver
// ---------------------------------------------------------------------------------------------

#[test]
fn without_a_driver_every_context_free_entry_point_is_not_found() {
    let Err(error) = cuweave_driver::driver() else {
        assert!(cuweave_driver::is_available());
        assert!(Context::current_raw().is_ok());
        return;
    };
    if !error.is_not_found() {
        // A driver that loads but does not initialise: every call reports that same error.
        eprintln!("the driver loaded but failed: {error}");
    }
    assert!(!cuweave_driver::is_available());
    assert_eq!(Context::current_raw().err(), Some(error.clone()));
    assert_eq!(
        memory::pointer_attributes(0x1000).err(),
        Some(error.clone())
    );
    assert_eq!(
        cuweave_driver::graph::CaptureModeGuard::enter(CaptureMode::Relaxed).err(),
        Some(error.clone())
    );
    assert_eq!(Device::count().err(), Some(error.clone()));
    assert_eq!(Device::get(0).err(), Some(error.clone()));
    assert_eq!(cuweave_driver::driver_version().err(), Some(error.clone()));
    assert_eq!(cuweave_driver::graph::active_captures(), 0);
    assert_eq!(cuweave_driver::empty_process_caches(), 0);
    // The error explains itself.
    let text = error.to_string();
    assert!(!text.is_empty());
}
