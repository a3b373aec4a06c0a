//! What cudarc users write, in cuweave's driver API: one module with several kernels launched
//! with every common argument type, launches at the limits, fork/join across streams with
//! events, streams made by another library, events that time and refuse misuse, zeroed and
//! odd-sized memory, overlapping copies, memory info around a 1 GiB allocation, and handles
//! used from other threads after their creator let go of the context.
//!
//! cudarc names beside ours: `CudaContext` is `Arc<Context>`, `CudaStream` is `Stream` (fork:
//! record an event, `wait_event` it on the child; join: the reverse), `CudaModule` /
//! `CudaFunction` are `Module` / `Kernel`, `launch_builder` is `KernelArgs` with an `unsafe`
//! `Kernel::launch`, `alloc_zeros` is `DeviceAllocation::zeroed`, `htod_copy` /
//! `dtoh_sync_copy` / `memcpy_*` are `memory::copy_*`, and `DevicePtr` is a raw address.

use std::sync::Arc;

use cuweave_driver::memory::{self, DeviceAllocation};
use cuweave_driver::{
    Context, Device, DriverError, Event, EventFlags, KernelArgs, LaunchConfig, Module, Stream,
    StreamFlags, sys,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::launch_kernels::LaunchKernels;
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;
const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;

/// Two kernels in one hand-written module (sm_75 PTX, JIT-compiled for any later device):
///
/// ```cuda
/// struct Affine { int mul; unsigned char xor_; double offset; };
/// extern "C" __global__ void mix_typed(unsigned char* bytes, int* ints, double* doubles,
///                                      unsigned n, int add, double scale, Affine s) {
///     unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
///     if (i >= n) return;
///     bytes[i] ^= s.xor_;
///     ints[i] = ints[i] * s.mul + add;
///     doubles[i] = __dadd_rn(__dmul_rn(doubles[i], scale), s.offset);
/// }
/// // Exits at once in every thread but the last thread of the last block, which writes its
/// // block and thread index: proof that a grid ran to its end.
/// extern "C" __global__ void mark_last(unsigned* out) {
///     if (blockIdx.x == gridDim.x - 1 && threadIdx.x == blockDim.x - 1) {
///         out[0] = blockIdx.x;
///         out[1] = threadIdx.x;
///     }
/// }
/// ```
const MIXED_PTX: &str = r"
.version 8.0
.target sm_75
.address_size 64

.visible .entry mix_typed(
	.param .u64 mix_typed_param_0,
	.param .u64 mix_typed_param_1,
	.param .u64 mix_typed_param_2,
	.param .u32 mix_typed_param_3,
	.param .u32 mix_typed_param_4,
	.param .f64 mix_typed_param_5,
	.param .align 8 .b8 mix_typed_param_6[16]
)
{
	.reg .pred 	%p<2>;
	.reg .b16 	%rs<4>;
	.reg .b32 	%r<10>;
	.reg .f64 	%fd<6>;
	.reg .b64 	%rd<13>;

	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %ntid.x;
	mov.u32 	%r3, %tid.x;
	mad.lo.s32 	%r4, %r1, %r2, %r3;
	ld.param.u32 	%r5, [mix_typed_param_3];
	setp.ge.u32 	%p1, %r4, %r5;
	@%p1 bra 	$L__mix_done;

	ld.param.u64 	%rd1, [mix_typed_param_0];
	ld.param.u64 	%rd2, [mix_typed_param_1];
	ld.param.u64 	%rd3, [mix_typed_param_2];
	ld.param.u32 	%r6, [mix_typed_param_4];
	ld.param.f64 	%fd1, [mix_typed_param_5];
	ld.param.s32 	%r7, [mix_typed_param_6];
	ld.param.u8 	%rs1, [mix_typed_param_6+4];
	ld.param.f64 	%fd2, [mix_typed_param_6+8];
	cvta.to.global.u64 	%rd4, %rd1;
	cvta.to.global.u64 	%rd5, %rd2;
	cvta.to.global.u64 	%rd6, %rd3;
	cvt.u64.u32 	%rd7, %r4;
	add.s64 	%rd8, %rd4, %rd7;
	ld.global.u8 	%rs2, [%rd8];
	xor.b16 	%rs3, %rs2, %rs1;
	st.global.u8 	[%rd8], %rs3;
	shl.b64 	%rd9, %rd7, 2;
	add.s64 	%rd10, %rd5, %rd9;
	ld.global.u32 	%r8, [%rd10];
	mad.lo.s32 	%r9, %r8, %r7, %r6;
	st.global.u32 	[%rd10], %r9;
	shl.b64 	%rd11, %rd7, 3;
	add.s64 	%rd12, %rd6, %rd11;
	ld.global.f64 	%fd3, [%rd12];
	mul.rn.f64 	%fd4, %fd3, %fd1;
	add.rn.f64 	%fd5, %fd4, %fd2;
	st.global.f64 	[%rd12], %fd5;

$L__mix_done:
	ret;

}

.visible .entry mark_last(
	.param .u64 mark_last_param_0
)
{
	.reg .pred 	%p<3>;
	.reg .b32 	%r<7>;
	.reg .b64 	%rd<3>;

	mov.u32 	%r1, %ctaid.x;
	mov.u32 	%r2, %nctaid.x;
	add.s32 	%r3, %r2, -1;
	setp.ne.s32 	%p1, %r1, %r3;
	@%p1 bra 	$L__mark_done;

	mov.u32 	%r4, %tid.x;
	mov.u32 	%r5, %ntid.x;
	add.s32 	%r6, %r5, -1;
	setp.ne.s32 	%p2, %r4, %r6;
	@%p2 bra 	$L__mark_done;

	ld.param.u64 	%rd1, [mark_last_param_0];
	cvta.to.global.u64 	%rd2, %rd1;
	st.global.u32 	[%rd2], %r1;
	st.global.u32 	[%rd2+4], %r4;

$L__mark_done:
	ret;

}
";

/// `Affine` of [`MIXED_PTX`], passed by value.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct Affine {
    mul: i32,
    xor: u8,
    _pad: [u8; 3],
    offset: f64,
}

fn upload<T: Copy>(context: &Arc<Context>, values: &[T]) -> DeviceAllocation {
    let bytes = std::mem::size_of_val(values);
    let buffer = DeviceAllocation::new(context, bytes).unwrap();
    // SAFETY: `values` is readable for `bytes`, the allocation as long.
    unsafe { memory::copy_htod(context, buffer.ptr(), values.as_ptr().cast(), bytes) }.unwrap();
    buffer
}

fn download<T: Copy + Default>(buffer: &DeviceAllocation, offset: usize, n: usize) -> Vec<T> {
    let mut host = vec![T::default(); n];
    let bytes = n * size_of::<T>();
    assert!(offset + bytes <= buffer.len());
    // SAFETY: `host` holds `bytes`, and the range lies inside the allocation (checked).
    unsafe {
        memory::copy_dtoh(
            buffer.context(),
            host.as_mut_ptr().cast(),
            buffer.ptr() + offset as u64,
            bytes,
        )
    }
    .unwrap();
    host
}

fn pattern(bytes: usize, seed: u8) -> Vec<u8> {
    (0..bytes)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn assert_invalid<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected InvalidArgument, got {other:?}"),
    }
}

/// Test kernels with every kernel these tests queue behind a spin launched once: with lazy
/// module loading (the default since CUDA 12.2) a kernel's first launch loads it, which may
/// synchronise the context and so end a spin that a test wants still running.
fn warmed_kernels(context: &Arc<Context>) -> TestKernels {
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let scratch = DeviceAllocation::zeroed(context, 64).unwrap();
    kernels.spin_ns(&stream, 0).unwrap();
    // SAFETY: `scratch` holds 16 u32s (the first 8 bytes also serve as the u64 sum) until the
    // synchronize below.
    unsafe {
        kernels.fill_u32(&stream, scratch.ptr(), 0, 8).unwrap();
        kernels.increment_u32(&stream, scratch.ptr(), 8).unwrap();
        kernels
            .checksum_u32(&stream, scratch.ptr() + 32, 8, scratch.ptr())
            .unwrap();
    }
    stream.synchronize().unwrap();
    kernels
}

fn attribute(device: Device, attribute: sys::CUdevice_attribute) -> u32 {
    u32::try_from(device.attribute(attribute).unwrap()).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Modules and launches
// ---------------------------------------------------------------------------------------------

#[test]
fn one_module_with_several_kernels_takes_byte_int_double_pointers_scalars_and_a_struct() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let module = Module::from_ptx(context, MIXED_PTX).unwrap();
    let mix = module.function("mix_typed").unwrap();
    let mark = module.function("mark_last").unwrap();
    assert!(Arc::ptr_eq(mix.module(), mark.module()));
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();

    // An odd count, so the last block is partly out of range.
    const N: usize = 1001;
    let bytes_in = pattern(N, 7);
    let ints_in: Vec<i32> = (0..N as i32).map(|i| i * 7919 - 3_000_000).collect();
    let doubles_in: Vec<f64> = (0..N).map(|i| i as f64 * 0.1 - 3.7).collect();
    let (bytes, ints, doubles) = (
        upload(context, &bytes_in),
        upload(context, &ints_in),
        upload(context, &doubles_in),
    );
    let (bytes_ptr, ints_ptr, doubles_ptr) = (bytes.ptr(), ints.ptr(), doubles.ptr());
    let (n, add, scale) = (N as u32, -123_456i32, -1.25f64);
    let affine = Affine {
        mul: -40_503,
        xor: 0x5a,
        _pad: [0; 3],
        offset: 1e-3,
    };
    let args = KernelArgs::new()
        .arg(&bytes_ptr)
        .arg(&ints_ptr)
        .arg(&doubles_ptr)
        .arg(&n)
        .arg(&add)
        .arg(&scale)
        .arg(&affine);
    // SAFETY: mix_typed(u8*, i32*, f64*, u32, i32, f64, Affine) matches, `Affine` is repr(C)
    // with the kernel's layout (16 bytes, align 8); each buffer holds N elements and lives
    // until the synchronize below.
    unsafe { mix.launch(&stream, LaunchConfig::for_elements(N, 128).unwrap(), &args) }.unwrap();
    let out = DeviceAllocation::zeroed(context, 8).unwrap();
    let out_ptr = out.ptr();
    // SAFETY: mark_last(unsigned*) matches; `out` holds two u32s.
    unsafe {
        mark.launch(
            &stream,
            LaunchConfig::for_elements(N, 128).unwrap(),
            &KernelArgs::new().arg(&out_ptr),
        )
    }
    .unwrap();
    stream.synchronize().unwrap();

    let expected_bytes: Vec<u8> = bytes_in.iter().map(|b| b ^ affine.xor).collect();
    assert_eq!(download::<u8>(&bytes, 0, N), expected_bytes);
    let expected_ints: Vec<i32> = ints_in
        .iter()
        .map(|i| i.wrapping_mul(affine.mul).wrapping_add(add))
        .collect();
    assert_eq!(download::<i32>(&ints, 0, N), expected_ints);
    let expected_doubles: Vec<u64> = doubles_in
        .iter()
        .map(|d| (d * scale + affine.offset).to_bits())
        .collect();
    let doubles_out: Vec<u64> = download::<f64>(&doubles, 0, N)
        .iter()
        .map(|d| d.to_bits())
        .collect();
    assert_eq!(doubles_out, expected_doubles, "f64 results bit for bit");
    // for_elements(1001, 128): 8 blocks, the last thread of block 7 is thread 127.
    assert_eq!(download::<u32>(&out, 0, 2), [7, 127]);
}

#[test]
fn launches_at_the_block_limit_and_a_large_grid_run_and_past_the_limits_are_typed_errors() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let module = Module::from_ptx(context, MIXED_PTX).unwrap();
    let mark = module.function("mark_last").unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let max_threads = attribute(
        gpu.device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK,
    );
    assert_eq!(max_threads, LaunchConfig::MAX_BLOCK_THREADS);
    let max_grid_x = attribute(
        gpu.device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X,
    );
    assert_eq!(max_grid_x, LaunchConfig::MAX_GRID_X);

    let out = DeviceAllocation::zeroed(context, 8).unwrap();
    let out_ptr = out.ptr();
    let args = KernelArgs::new().arg(&out_ptr);
    let launch = |grid: (u32, u32, u32), block: (u32, u32, u32)| {
        let config = LaunchConfig {
            grid,
            block,
            shared_mem_bytes: 0,
        };
        // SAFETY: mark_last(unsigned*) matches; only one thread writes, to `out`'s two u32s.
        unsafe { mark.launch(&stream, config, &args) }
    };
    let last = |stream: &Stream| {
        stream.synchronize().unwrap();
        download::<u32>(&out, 0, 2)
    };

    // A block of the most threads a block may have.
    launch((3, 1, 1), (max_threads, 1, 1)).unwrap();
    assert_eq!(last(&stream), [2, max_threads - 1]);
    // 2^24 blocks of one thread, each exiting at once but the very last: quick, and far past
    // the 65 535 blocks of y and z.
    launch((1 << 24, 1, 1), (1, 1, 1)).unwrap();
    assert_eq!(last(&stream), [(1 << 24) - 1, 0]);

    // Past the limits: typed errors, never a crash, and nothing ran.
    assert_invalid(launch((1, 1, 1), (0, 1, 1)), "a block of zero threads");
    assert_invalid(launch((0, 1, 1), (1, 1, 1)), "a grid of zero blocks");
    for (grid, block, what) in [
        (
            (1, 1, 1),
            (max_threads + 1, 1, 1),
            "a block of 1025 threads",
        ),
        ((1, 1, 1), (u32::MAX, 1, 1), "a block of u32::MAX threads"),
        (
            (max_grid_x + 1, 1, 1),
            (1, 1, 1),
            "a grid of 2^31 blocks in x",
        ),
        (
            (u32::MAX, 1, 1),
            (1, 1, 1),
            "a grid of u32::MAX blocks in x",
        ),
    ] {
        match launch(grid, block) {
            Err(DriverError::Cuda { .. } | DriverError::InvalidArgument { .. }) => {}
            other => panic!("{what}: expected a typed error, got {other:?}"),
        }
    }
    assert_eq!(last(&stream), [(1 << 24) - 1, 0], "no refused launch ran");
    // The context still launches.
    launch((5, 1, 1), (64, 1, 1)).unwrap();
    assert_eq!(last(&stream), [4, 63]);
}

#[test]
fn dynamic_shared_memory_past_48_kib_fills_a_whole_wave_the_occupancy_query_sized() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    const DYNAMIC: usize = 100 * 1024;
    const BLOCK: u32 = 256;
    let opt_in = attribute(
        gpu.device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    ) as usize;
    if opt_in < DYNAMIC {
        cuweave_test_support::skip(
            "dynamic_shared_memory_past_48_kib",
            "the device cannot opt in to 100 KiB of shared memory per block",
        );
        return;
    }
    let kernels = LaunchKernels::load(context).unwrap();
    let kernel = kernels.shared_sum_u32();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let words = (DYNAMIC / 4) as u32;
    let config = |blocks: u32| LaunchConfig {
        grid: (blocks, 1, 1),
        block: (BLOCK, 1, 1),
        shared_mem_bytes: DYNAMIC as u32,
    };
    let sums = DeviceAllocation::zeroed(context, 8).unwrap();
    let sums_ptr = sums.ptr();
    let args = KernelArgs::new().arg(&words).arg(&sums_ptr);
    // Without the opt-in the launch is refused: 100 KiB is past the default 48 KiB.
    // SAFETY: shared_sum_u32(unsigned, unsigned long long*) matches; refused before it runs.
    let refused = unsafe { kernel.launch(&stream, config(1), &args) };
    assert!(
        matches!(refused, Err(DriverError::Cuda { .. })),
        "{refused:?}"
    );

    kernel
        .set_max_dynamic_shared_memory(DYNAMIC as u32)
        .unwrap();
    let per_sm = kernel
        .max_active_blocks_per_multiprocessor(BLOCK, DYNAMIC)
        .unwrap();
    let per_sm_shared = attribute(
        gpu.device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    ) as usize;
    assert!(
        per_sm >= 1 && per_sm as usize * DYNAMIC <= per_sm_shared,
        "{per_sm} blocks of 100 KiB on a multiprocessor of {per_sm_shared} bytes"
    );
    let sms = attribute(
        gpu.device,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    );
    let wave = per_sm * sms;
    let sums = DeviceAllocation::zeroed(context, wave as usize * 8).unwrap();
    let sums_ptr = sums.ptr();
    let args = KernelArgs::new().arg(&words).arg(&sums_ptr);
    // SAFETY: as above; `sums` holds one u64 per block of the wave.
    unsafe { kernel.launch(&stream, config(wave), &args) }.unwrap();
    stream.synchronize().unwrap();
    let expected = u64::from(words) * u64::from(words - 1) / 2;
    assert_eq!(
        download::<u64>(&sums, 0, wave as usize),
        vec![expected; wave as usize]
    );
}

// ---------------------------------------------------------------------------------------------
// Streams and events
// ---------------------------------------------------------------------------------------------

#[test]
fn fork_to_four_priority_streams_of_another_context_handle_and_join_back_in_order() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let kernels = warmed_kernels(context);
    let parent = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const N: usize = 1 << 16;
    const QUARTER: usize = N / 4;
    let data = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let sum = DeviceAllocation::zeroed(context, 8).unwrap();

    // Parent: a long spin, then the fill every child builds on.
    kernels.spin_ns(&parent, 30 * MS).unwrap();
    // SAFETY: `data` holds N u32s until the synchronize at the end.
    unsafe { kernels.fill_u32(&parent, data.ptr(), 1, N) }.unwrap();
    let fork = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    fork.record(&parent).unwrap();

    // Children on another handle of the same primary context (a second `CudaContext` of one
    // device), at both ends of the priority range.
    let other = Context::primary(gpu.device).unwrap();
    let range = other.stream_priority_range().unwrap();
    let mut joins = Vec::new();
    let mut children = Vec::new();
    for i in 0..4 {
        let priority = if i % 2 == 0 {
            range.greatest
        } else {
            range.least
        };
        let child = Stream::with_priority(&other, StreamFlags::NON_BLOCKING, priority).unwrap();
        assert_eq!(child.priority().unwrap(), priority);
        child.wait_event(&fork).unwrap();
        if i == 0 {
            // The join must wait for this one too.
            kernels.spin_ns(&child, 30 * MS).unwrap();
        }
        // SAFETY: the quarter lies inside `data`.
        unsafe { kernels.increment_u32(&child, data.ptr() + (i * QUARTER * 4) as u64, QUARTER) }
            .unwrap();
        let join = Event::new(&other, EventFlags::DISABLE_TIMING).unwrap();
        join.record(&child).unwrap();
        joins.push(join);
        children.push(child);
    }
    for join in &joins {
        parent.wait_event(join).unwrap();
    }
    // SAFETY: `data` holds N u32s, `sum` one u64.
    unsafe { kernels.checksum_u32(&parent, data.ptr(), N, sum.ptr()) }.unwrap();
    assert!(
        !parent.query().unwrap(),
        "the parent is still spinning or joined"
    );
    parent.synchronize().unwrap();
    for (i, child) in children.iter().enumerate() {
        assert!(child.query().unwrap(), "child {i} done before the join");
    }
    assert_eq!(
        download::<u64>(&sum, 0, 1),
        [2 * N as u64],
        "the checksum ran after every child"
    );
    assert_eq!(
        download::<u32>(&data, 0, N),
        vec![2; N],
        "every child ran after the fill"
    );
}

#[test]
fn stream_fork_and_wait_stream_order_work_as_cudarcs_fork_and_join() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let kernels = warmed_kernels(context);
    let parent = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const N: usize = 1 << 16;
    const HALF: usize = N / 2;
    let data = DeviceAllocation::zeroed(context, N * 4).unwrap();
    let sum = DeviceAllocation::zeroed(context, 8).unwrap();

    kernels.spin_ns(&parent, 30 * MS).unwrap();
    // SAFETY: `data` holds N u32s until the synchronize below.
    unsafe { kernels.fill_u32(&parent, data.ptr(), 1, N) }.unwrap();
    let (first, second) = (parent.fork().unwrap(), parent.fork().unwrap());
    for child in [&first, &second] {
        assert!(child.flags().unwrap().is_non_blocking());
        assert_eq!(child.context().as_raw(), context.as_raw());
        assert_ne!(child.as_raw(), parent.as_raw());
    }
    // The join must wait for this spin too.
    kernels.spin_ns(&first, 30 * MS).unwrap();
    // SAFETY: each half lies inside `data`.
    unsafe {
        kernels.increment_u32(&first, data.ptr(), HALF).unwrap();
        kernels
            .increment_u32(&second, data.ptr() + (HALF * 4) as u64, HALF)
            .unwrap();
    }
    parent.wait_stream(&first).unwrap();
    parent.wait_stream(&second).unwrap();
    // SAFETY: `data` holds N u32s, `sum` one u64.
    unsafe { kernels.checksum_u32(&parent, data.ptr(), N, sum.ptr()) }.unwrap();
    assert!(
        !parent.query().unwrap(),
        "the parent waits on a 60 ms chain"
    );
    parent.synchronize().unwrap();
    assert!(first.query().unwrap() && second.query().unwrap());
    assert_eq!(
        download::<u64>(&sum, 0, 1),
        [2 * N as u64],
        "joined before the sum"
    );
    assert_eq!(
        download::<u32>(&data, 0, N),
        vec![2; N],
        "forked after the fill"
    );
}

#[test]
fn a_stream_made_by_another_library_is_used_and_destroyed_exactly_once() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let kernels = warmed_kernels(context);
    let api = cuweave_driver::driver().unwrap();
    let range = context.stream_priority_range().unwrap();
    let create = api.stream_create_with_priority.get().unwrap();
    let query = api.stream_query.get().unwrap();
    let destroy = api.stream_destroy.get().unwrap();

    // "The other library": a raw high-priority non-blocking stream.
    context.bind_to_thread().unwrap();
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current on this thread.
    let code = unsafe {
        create(
            &mut raw,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0,
            range.greatest,
        )
    };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);

    // SAFETY: `raw` is a live stream of `context` and outlives the borrowed wrapper (it is
    // destroyed below, after the wrapper was dropped).
    let borrowed = unsafe { Stream::from_raw(context, raw, false) };
    assert_eq!(borrowed.priority().unwrap(), range.greatest);
    assert!(borrowed.flags().unwrap().is_non_blocking());
    let data = DeviceAllocation::zeroed(context, 4096 * 4).unwrap();
    kernels.spin_ns(&borrowed, 20 * MS).unwrap();
    // SAFETY: `data` holds 4096 u32s until the synchronize below.
    unsafe { kernels.fill_u32(&borrowed, data.ptr(), 5, 4096) }.unwrap();
    let done = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    done.record(&borrowed).unwrap();
    let ours = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    ours.wait_event(&done).unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&ours, data.ptr(), 4096) }.unwrap();
    drop(borrowed);
    // The raw stream is still alive and still busy: the wrapper destroyed nothing.
    // SAFETY: `raw` is live.
    let busy = unsafe { query(raw) };
    assert_eq!(busy, sys::CUresult::CUDA_ERROR_NOT_READY);
    ours.synchronize().unwrap();
    assert_eq!(download::<u32>(&data, 0, 4096), vec![6; 4096]);
    // SAFETY: `raw` is live.
    assert_eq!(unsafe { query(raw) }, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: `raw` is live and idle, and destroyed once, here, by its creator.
    assert_eq!(unsafe { destroy(raw) }, sys::CUresult::CUDA_SUCCESS);

    // Ownership handed over: the wrapper destroys it when dropped, with work still queued.
    let mut raw: sys::CUstream = std::ptr::null_mut();
    // SAFETY: valid out-pointer; the context is current on this thread.
    let code = unsafe {
        create(
            &mut raw,
            sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0,
            range.least,
        )
    };
    assert_eq!(code, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: `raw` is live, and nobody else destroys it.
    let owned = unsafe { Stream::from_raw(context, raw, true) };
    assert_eq!(owned.priority().unwrap(), range.least);
    kernels.spin_ns(&owned, 10 * MS).unwrap();
    // SAFETY: as above.
    unsafe { kernels.fill_u32(&owned, data.ptr(), 9, 4096) }.unwrap();
    let done = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    done.record(&owned).unwrap();
    drop(owned);
    done.synchronize().unwrap();
    assert_eq!(download::<u32>(&data, 0, 4096), vec![9; 4096]);
}

#[test]
fn timing_events_measure_a_spin_and_misused_events_are_typed_errors() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let kernels = warmed_kernels(context);
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let (start, end) = (
        Event::new(context, EventFlags::TIMING).unwrap(),
        Event::new(context, EventFlags::TIMING).unwrap(),
    );
    // Never recorded: complete, as cudaEventQuery says; no time between them.
    assert!(start.query().unwrap());
    match start.elapsed_ms(&end) {
        Err(DriverError::Cuda { .. }) => {}
        other => panic!("elapsed time of unrecorded events: {other:?}"),
    }

    kernels.spin_ns(&stream, MS).unwrap();
    start.record(&stream).unwrap();
    kernels.spin_ns(&stream, 25 * MS).unwrap();
    end.record(&stream).unwrap();
    assert!(!end.query().unwrap(), "recorded behind a 25 ms spin");
    match start.elapsed_ms(&end) {
        Err(error) if error.is_not_ready() => {}
        other => panic!("elapsed time while the end is pending: {other:?}"),
    }
    end.synchronize().unwrap();
    let ms = start.elapsed_ms(&end).unwrap();
    assert!((20.0..5_000.0).contains(&ms), "{ms} ms for a 25 ms spin");
    let back = end.elapsed_ms(&start).unwrap();
    assert!(
        (back + ms).abs() < 0.01,
        "{back} ms backwards, {ms} forwards"
    );

    // Timing needs timing on both ends, checked before the driver is asked.
    let plain = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    plain.record(&stream).unwrap();
    plain.synchronize().unwrap();
    assert_invalid(start.elapsed_ms(&plain), "a non-timing end");
    assert_invalid(plain.elapsed_ms(&end), "a non-timing start");
}

// ---------------------------------------------------------------------------------------------
// Memory
// ---------------------------------------------------------------------------------------------

#[test]
fn a_zeroed_allocation_is_zero_where_a_dirtied_block_of_its_size_was_freed() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    const BYTES: usize = 4 * MIB + 12;
    for round in 0..3 {
        let dirty = DeviceAllocation::new(context, BYTES).unwrap();
        // SAFETY: the allocation is BYTES long.
        unsafe { memory::memset_d8(context, dirty.ptr(), 0xa5, BYTES) }.unwrap();
        assert_eq!(download::<u8>(&dirty, BYTES - 4, 4), [0xa5; 4]);
        dirty.free().unwrap();
        let zeroed = DeviceAllocation::zeroed(context, BYTES).unwrap();
        assert_eq!(zeroed.len(), BYTES);
        assert!(
            download::<u8>(&zeroed, 0, BYTES).iter().all(|&b| b == 0),
            "round {round}: a zeroed allocation holds old bytes"
        );
    }
    assert_invalid(DeviceAllocation::zeroed(context, 0), "zero bytes");
}

#[test]
fn one_byte_odd_sized_and_zero_byte_copies_land_exactly_where_asked() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const LEN: usize = 8192;
    let device = DeviceAllocation::zeroed(context, LEN).unwrap();
    let base = device.ptr();
    let mut model = vec![0u8; LEN];

    // One byte at an odd address.
    let one = [0xc3u8];
    // SAFETY: one byte at offset 1 of the allocation.
    unsafe { memory::copy_htod(context, base + 1, one.as_ptr(), 1) }.unwrap();
    model[1] = 0xc3;
    // An odd size at an odd offset, both ways.
    let odd = pattern(1023, 3);
    // SAFETY: 1023 bytes at offset 3 lie inside the allocation.
    unsafe { memory::copy_htod(context, base + 3, odd.as_ptr(), odd.len()) }.unwrap();
    model[3..3 + 1023].copy_from_slice(&odd);
    // Device to device inside one allocation, disjoint, unaligned both sides.
    // SAFETY: [3, 1026) and [4097, 5120) lie inside the allocation and do not overlap.
    unsafe { memory::copy_dtod(context, base + 4097, base + 3, 1023) }.unwrap();
    model.copy_within(3..1026, 4097);
    // The async forms on a stream, at other odd places.
    let tail = pattern(777, 9);
    // SAFETY: 777 bytes at offset 6001 lie inside; `tail` lives until the synchronize.
    unsafe { memory::copy_htod_async(base + 6001, tail.as_ptr(), tail.len(), &stream) }.unwrap();
    model[6001..6778].copy_from_slice(&tail);
    // SAFETY: [6001, 6778) and [7001, 7778) are disjoint ranges of the allocation.
    unsafe { memory::copy_dtod_async(base + 7001, base + 6001, 777, &stream) }.unwrap();
    model.copy_within(6001..6778, 7001);
    let mut back = [0u8; 5];
    // SAFETY: 5 bytes at offset 7773 lie inside; `back` is read after the synchronize.
    unsafe { memory::copy_dtoh_async(back.as_mut_ptr(), base + 7773, 5, &stream) }.unwrap();

    // Zero bytes: accepted, nothing moves, sync or async.
    let sentinel = [0xeeu8; 4];
    let mut untouched = [0x11u8; 4];
    // SAFETY: every range is zero bytes long, at valid addresses.
    unsafe {
        memory::copy_htod(context, base, sentinel.as_ptr(), 0).unwrap();
        memory::copy_dtoh(context, untouched.as_mut_ptr(), base + 1, 0).unwrap();
        memory::copy_dtod(context, base, base + 1, 0).unwrap();
        memory::copy_htod_async(base, sentinel.as_ptr(), 0, &stream).unwrap();
        memory::copy_dtod_async(base + 2, base + 1, 0, &stream).unwrap();
        memory::memset_d8(context, base, 0xee, 0).unwrap();
        memory::memset_d8_async(base, 0xee, 0, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert_eq!(untouched, [0x11; 4]);
    assert_eq!(back, model[7773..7778]);
    let all = download::<u8>(&device, 0, LEN);
    if let Some(at) = (0..LEN).find(|&i| all[i] != model[i]) {
        panic!(
            "byte {at}: {:#04x} on the device, {:#04x} expected",
            all[at], model[at]
        );
    }
    // One byte back from the last address of the allocation.
    assert_eq!(download::<u8>(&device, LEN - 1, 1), [model[LEN - 1]]);
}

#[test]
fn overlapping_copies_inside_one_allocation_are_refused_and_a_temporary_shifts_the_bytes() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    const LEN: usize = 4 * MIB;
    const SHIFT: usize = 4096 + 1;
    const BYTES: usize = LEN - SHIFT;
    let start = pattern(LEN, 11);
    let device = upload(context, &start);
    let base = device.ptr();

    // Forwards and backwards by SHIFT, one byte of overlap, through every copy entry point.
    let overlapping = [
        (base + SHIFT as u64, base, BYTES),
        (base, base + SHIFT as u64, BYTES),
        (base + 1, base, 2),
    ];
    for (dst, src, bytes) in overlapping {
        // SAFETY: every range lies inside the allocation; each call is refused before the
        // driver is asked (what this test checks).
        unsafe {
            assert_invalid(memory::copy_dtod(context, dst, src, bytes), "copy_dtod");
            assert_invalid(
                memory::copy_dtod_async(dst, src, bytes, &stream),
                "copy_dtod_async",
            );
            assert_invalid(memory::copy(context, dst, src, bytes), "copy");
            assert_invalid(memory::copy_async(dst, src, bytes, &stream), "copy_async");
        }
    }
    // A copy onto itself changes nothing and is allowed.
    // SAFETY: the whole allocation onto itself.
    unsafe { memory::copy_dtod(context, base, base, LEN) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(download::<u8>(&device, 0, LEN), start, "nothing moved");

    // What to do instead: through a temporary, as memmove would.
    let temporary = DeviceAllocation::new(context, BYTES).unwrap();
    // SAFETY: disjoint allocations, BYTES inside each; ordered on one stream.
    unsafe {
        memory::copy_dtod_async(temporary.ptr(), base, BYTES, &stream).unwrap();
        memory::copy_dtod_async(base + SHIFT as u64, temporary.ptr(), BYTES, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    let mut expected = start.clone();
    expected.copy_within(0..BYTES, SHIFT);
    assert!(
        download::<u8>(&device, 0, LEN) == expected,
        "the shifted bytes differ from memmove's"
    );
}

#[test]
fn memory_info_accounts_for_a_gib_of_plain_device_memory_and_its_free() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let context = &gpu.context;
    let before = context.memory_info().unwrap();
    assert!(before.free <= before.total);
    if before.free < GIB + 512 * MIB {
        cuweave_test_support::skip(
            "memory_info_accounts_for_a_gib",
            "less than 1.5 GiB of device memory is free",
        );
        return;
    }
    // Tolerance for other tests' allocations in this process (a few MiB each) and the driver's
    // own rounding.
    const SLACK: usize = 128 * MIB;
    let gib = DeviceAllocation::new(context, GIB).unwrap();
    // SAFETY: the allocation is GIB long.
    unsafe { memory::memset_d32(context, gib.ptr(), 0x3f80_0000, GIB / 4) }.unwrap();
    let during = context.memory_info().unwrap();
    assert_eq!(during.total, before.total);
    assert!(
        during.free + GIB <= before.free + SLACK,
        "free went from {} to {} around a 1 GiB allocation",
        before.free,
        during.free
    );
    assert_eq!(download::<u32>(&gib, GIB - 8, 2), [0x3f80_0000; 2]);
    gib.free().unwrap();
    let after = context.memory_info().unwrap();
    assert!(
        after.free + SLACK >= during.free + GIB,
        "free went from {} to {} after freeing 1 GiB",
        during.free,
        after.free
    );
}

// ---------------------------------------------------------------------------------------------
// Contexts and threads
// ---------------------------------------------------------------------------------------------

#[test]
fn handles_outlive_the_context_handle_they_were_made_from_on_another_thread() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let device = gpu.device;
    // Another thread makes its own context handle, everything from it, then lets it go.
    let (kernels, stream, timing, data) = std::thread::spawn(move || {
        let context = Context::primary(device).unwrap();
        let kernels = TestKernels::load(&context).unwrap();
        let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).unwrap();
        let timing = (
            Event::new(&context, EventFlags::TIMING).unwrap(),
            Event::new(&context, EventFlags::TIMING).unwrap(),
        );
        let data = DeviceAllocation::zeroed(&context, 1024 * 4).unwrap();
        drop(context);
        (kernels, stream, timing, data)
    })
    .join()
    .unwrap();
    drop(gpu);

    // This thread has no handle of its own: every call makes the handle's context current.
    timing.0.record(&stream).unwrap();
    // SAFETY: `data` holds 1024 u32s until the synchronize below.
    unsafe { kernels.fill_u32(&stream, data.ptr(), 3, 1024) }.unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&stream, data.ptr(), 1024) }.unwrap();
    timing.1.record(&stream).unwrap();
    timing.1.synchronize().unwrap();
    assert!(timing.0.elapsed_ms(&timing.1).unwrap() >= 0.0);
    assert_eq!(download::<u32>(&data, 0, 1024), vec![4; 1024]);
    assert_eq!(
        Context::current_raw().unwrap(),
        stream.context().as_raw(),
        "the handle's context is current after use"
    );
    // Dropped in an order unlike their creation: the module first, the stream, events, memory.
    drop(kernels);
    drop(stream);
    drop(timing);
    data.free().unwrap();
}

#[test]
fn eight_threads_make_the_primary_context_current_and_launch_at_once() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = warmed_kernels(&gpu.context);
    const N: usize = 64 * 1024;
    const ROUNDS: u32 = 16;
    let barrier = std::sync::Barrier::new(8);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8u32)
            .map(|id| {
                let (kernels, barrier, device) = (&kernels, &barrier, gpu.device);
                scope.spawn(move || {
                    let context = Context::primary(device).unwrap();
                    assert_eq!(context.as_raw(), kernels.module().context().as_raw());
                    let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).unwrap();
                    let data = DeviceAllocation::zeroed(&context, N * 4).unwrap();
                    barrier.wait();
                    // SAFETY: `data` holds N u32s until the synchronize below.
                    unsafe { kernels.fill_u32(&stream, data.ptr(), id * 1000, N) }.unwrap();
                    for _ in 0..ROUNDS {
                        // SAFETY: as above.
                        unsafe { kernels.increment_u32(&stream, data.ptr(), N) }.unwrap();
                    }
                    stream.synchronize().unwrap();
                    assert_eq!(Context::current_raw().unwrap(), context.as_raw());
                    let values = download::<u32>(&data, 0, N);
                    assert!(
                        values.iter().all(|&v| v == id * 1000 + ROUNDS),
                        "thread {id} saw another thread's values"
                    );
                })
            })
            .collect();
        for handle in handles {
            handle.join().unwrap();
        }
    });
}

/// `alloc_zeros` beside a long kernel on a blocking stream: the clearing runs on a stream of
/// its own, so the allocation returns, zeroed, while that kernel still runs (the legacy
/// stream's `cuMemsetD8` would have waited for it).
#[test]
fn zeroed_allocations_do_not_wait_for_the_blocking_streams_work() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let blocking = Stream::new(context, StreamFlags::DEFAULT).unwrap();
    // Leave non-zero bytes behind where the next allocation may land.
    let dirty = DeviceAllocation::new(context, 4 * MIB).unwrap();
    // SAFETY: `dirty` is 4 MiB of device memory of `context`; the memset waits for itself.
    unsafe { memory::memset_d8(context, dirty.ptr(), 0xa5, 4 * MIB) }.unwrap();
    drop(dirty);

    kernels.spin_ns(&blocking, 500 * MS).unwrap();
    let zeroed = DeviceAllocation::zeroed(context, 4 * MIB).unwrap();
    assert!(
        !blocking.query().unwrap(),
        "zeroed waited for the blocking stream's 500 ms kernel"
    );
    blocking.synchronize().unwrap();
    let mut host = vec![0xffu8; 4 * MIB];
    // SAFETY: `host` and `zeroed` are 4 MiB each; nothing else uses them.
    unsafe { memory::copy_dtoh(context, host.as_mut_ptr(), zeroed.ptr(), 4 * MIB) }.unwrap();
    assert!(
        host.iter().all(|&byte| byte == 0),
        "zeroed memory was not zero"
    );
}
