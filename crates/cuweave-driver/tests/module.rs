//! Loading modules and launching kernels on a real GPU; bad modules and names are driver errors,
//! not panics, and leave the context usable.

use std::sync::Arc;

use cuweave_driver::memory::{self, DeviceAllocation};
use cuweave_driver::{
    Context, DriverError, KernelArgs, LaunchConfig, Module, Stream, StreamFlags, sys,
};
use cuweave_test_support::kernels::{PTX, TestKernels};
use cuweave_test_support::require_gpu;

const N: usize = 1 << 20;

/// Copies `values` into a new device allocation, ordered on `stream`.
fn upload(context: &Arc<Context>, values: &[f32], stream: &Stream) -> DeviceAllocation {
    let bytes = size_of_val(values);
    let buffer = DeviceAllocation::new(context, bytes).unwrap();
    // SAFETY: `buffer` holds `bytes` bytes; the caller keeps `values` unchanged, and `buffer`
    // alive, until it has synchronized `stream`.
    unsafe { memory::copy_htod_async(buffer.ptr(), values.as_ptr().cast(), bytes, stream) }
        .unwrap();
    buffer
}

/// Copies `buffer` back as `n` floats, ordered on `stream`, and synchronizes it.
fn download(buffer: &DeviceAllocation, n: usize, stream: &Stream) -> Vec<f32> {
    let mut values = vec![f32::NAN; n];
    assert!(n * 4 <= buffer.len());
    // SAFETY: `values` is writable for `n` floats, all inside `buffer`; it is read only after
    // the synchronize.
    unsafe {
        memory::copy_dtoh_async(values.as_mut_ptr().cast(), buffer.ptr(), n * 4, stream).unwrap()
    };
    stream.synchronize().unwrap();
    values
}

fn first_mismatch(actual: &[f32], expected: impl Fn(usize) -> f32) -> Option<(usize, f32, f32)> {
    actual
        .iter()
        .enumerate()
        .find(|&(i, &value)| value != expected(i))
        .map(|(i, &value)| (i, value, expected(i)))
}

#[test]
fn add_and_saxpy_compute_a_million_elements() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    // Small integers and quarters: every sum and product below is exact in f32, so the host's
    // arithmetic matches the GPU's whether or not it fused a multiply-add.
    let a = |i: usize| i as f32;
    let b = |i: usize| (i % 1000) as f32 * 0.25;
    let x = |i: usize| (i % 4096) as f32;
    let y = |i: usize| (i % 777) as f32;
    let host = |f: &dyn Fn(usize) -> f32| (0..N).map(f).collect::<Vec<f32>>();
    // Kept until the end: the copies may read them until the stream has passed them.
    let (ha, hb, hx, hy) = (host(&a), host(&b), host(&x), host(&y));
    let (da, db, dx, dy) = (
        upload(context, &ha, &stream),
        upload(context, &hb, &stream),
        upload(context, &hx, &stream),
        upload(context, &hy, &stream),
    );
    let sum = DeviceAllocation::new(context, N * 4).unwrap();
    // SAFETY: every buffer holds N floats and outlives the synchronizes in `download`.
    unsafe {
        kernels
            .add_f32(&stream, da.ptr(), db.ptr(), sum.ptr(), N)
            .unwrap();
        kernels
            .saxpy_f32(&stream, 2.5, dx.ptr(), dy.ptr(), N)
            .unwrap();
    }
    let added = download(&sum, N, &stream);
    assert_eq!(first_mismatch(&added, |i| a(i) + b(i)), None);
    let saxpy = download(&dy, N, &stream);
    assert_eq!(first_mismatch(&saxpy, |i| 2.5 * x(i) + y(i)), None);
}

#[test]
fn a_kernel_keeps_its_module_loaded() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let module = Module::from_ptx(context, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    assert_eq!(fill.name(), "fill_u32");
    assert!(Arc::ptr_eq(fill.module(), &module));
    // The kernel's own handle is now the only one keeping the module loaded.
    drop(module);

    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let n: u64 = 10_000;
    let buffer = DeviceAllocation::new(context, n as usize * 4).unwrap();
    let (dst, value) = (buffer.ptr(), 0x7E57_u32);
    let args = KernelArgs::new().arg(&dst).arg(&value).arg(&n);
    let mut host = vec![0u32; n as usize];
    // SAFETY: fill_u32(unsigned*, unsigned, size_t) matches the three arguments, and `buffer`
    // holds `n` u32s until the synchronize; `host` is read only after it.
    unsafe {
        fill.launch(
            &stream,
            LaunchConfig::for_elements(n as usize, 256).unwrap(),
            &args,
        )
        .unwrap();
        memory::copy_dtoh_async(host.as_mut_ptr().cast(), dst, n as usize * 4, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(host.iter().all(|&word| word == value));

    let mut empty = LaunchConfig::for_elements(n as usize, 256).unwrap();
    empty.grid.0 = 0;
    // SAFETY: refused before the launch reaches the driver.
    match unsafe { fill.launch(&stream, empty, &args) } {
        Err(DriverError::InvalidArgument { operation, .. }) => {
            assert_eq!(operation, "Kernel::launch");
        }
        other => panic!("a launch with an empty grid gave {other:?}"),
    }
}

#[test]
fn garbage_ptx_is_a_driver_error_and_the_context_survives_it() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let garbage = ".version what\nthis is not PTX { at all";
    match Module::from_ptx(context, garbage) {
        Err(error @ DriverError::ModuleLoad { operation, .. }) => {
            let (name, description) = (error.name().unwrap(), error.description().unwrap());
            eprintln!("garbage PTX: {name}: {description}");
            assert_eq!(operation, "cuModuleLoadDataEx");
            assert!(name.starts_with("CUDA_ERROR_"), "{name}");
        }
        other => panic!("garbage PTX gave {other:?}"),
    }
    // A failed JIT is not a sticky error: real PTX still loads and runs.
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&stream, 1000).unwrap();
    stream.synchronize().unwrap();
}

/// PTX that parses but does not assemble: an undeclared register on line 7.
const BROKEN_PTX: &str = "\
.version 8.0
.target sm_75
.address_size 64

.visible .entry cuweave_broken()
{
    mov.u32 %cuweave_undeclared, 7;
    ret;
}
";

/// A PTX error comes back with the JIT compiler's own words: the typed error carries the code
/// and a bounded, NUL-free log naming the bad symbol, and its message shows the log. Valid PTX
/// loads and launches after it, as before.
#[test]
fn broken_ptx_is_a_module_load_error_with_the_jit_log() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let error = Module::from_ptx(context, BROKEN_PTX).unwrap_err();
    eprintln!("broken PTX: {error}");
    let DriverError::ModuleLoad {
        code,
        operation,
        log,
    } = &error
    else {
        panic!("broken PTX gave {error:?}");
    };
    assert_eq!(*operation, "cuModuleLoadDataEx");
    assert_eq!(error.code(), Some(sys::CUresult(*code)));
    assert!(error.name().unwrap().starts_with("CUDA_ERROR_"), "{error}");
    assert_eq!(error.jit_log(), Some(log.as_str()));
    assert!(log.to_lowercase().contains("error"), "log: {log:?}");
    assert!(log.contains("cuweave_undeclared"), "log: {log:?}");
    assert!(!log.contains('\0'), "log: {log:?}");
    assert!(log.len() <= 16 * 1024, "{} bytes of log", log.len());
    assert_eq!(log.trim(), log, "untrimmed log");
    assert!(error.to_string().contains("cuweave_undeclared"), "{error}");

    // Valid PTX still loads, and its kernel runs and writes what it should.
    let module = Module::from_ptx(context, PTX).unwrap();
    let fill = module.function("fill_u32").unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let n: u64 = 1000;
    let value: u32 = 0x600D_F00D;
    let buffer = DeviceAllocation::new(context, n as usize * 4).unwrap();
    let dst = buffer.ptr();
    let args = KernelArgs::new().arg(&dst).arg(&value).arg(&n);
    let mut host = vec![0u32; n as usize];
    // SAFETY: fill_u32(unsigned*, unsigned, size_t) matches the three arguments, and `buffer`
    // holds `n` u32s until the synchronize; `host` is read only after it.
    unsafe {
        fill.launch(
            &stream,
            LaunchConfig::for_elements(n as usize, 256).unwrap(),
            &args,
        )
        .unwrap();
        memory::copy_dtoh_async(host.as_mut_ptr().cast(), dst, n as usize * 4, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(host.iter().all(|&word| word == value));
}

#[test]
fn a_missing_function_is_not_found() {
    let gpu = require_gpu!();
    let module = Module::from_ptx(&gpu.context, PTX).unwrap();
    let error = module.function("nope").unwrap_err();
    assert_eq!(
        error.code(),
        Some(sys::CUresult::CUDA_ERROR_NOT_FOUND),
        "{error}"
    );
    assert!(
        matches!(
            &error,
            DriverError::Cuda {
                operation: "cuModuleGetFunction",
                ..
            }
        ) && error.name().unwrap() == "CUDA_ERROR_NOT_FOUND",
        "{error:?}"
    );
    // A name the driver could never be given is refused before it is asked.
    assert!(matches!(
        module.function("fill\0u32"),
        Err(DriverError::InvalidArgument { .. })
    ));
    // The module itself is fine.
    assert!(module.function("saxpy_f32").is_ok());
}

#[test]
fn images_that_cannot_be_passed_on_are_refused_up_front() {
    let gpu = require_gpu!();
    match Module::from_ptx(&gpu.context, "// a NUL \0 in PTX") {
        Err(DriverError::InvalidArgument { operation, reason }) => {
            assert_eq!(operation, "Module::from_ptx");
            assert!(reason.contains("NUL"), "{reason}");
        }
        other => panic!("PTX with a NUL gave {other:?}"),
    }
    match Module::from_cubin(&gpu.context, &[]) {
        Err(DriverError::InvalidArgument { operation, .. }) => {
            assert_eq!(operation, "Module::from_cubin");
        }
        other => panic!("an empty cubin gave {other:?}"),
    }
}

/// A cubin and a fatbin of `fill(unsigned* p, unsigned v, unsigned long long n)`, a kernel that
/// is not grid-stride: one thread per element (`tests/images/README.md`).
const CUBIN: &[u8] = include_bytes!("images/fill_sm90.cubin");
const FATBIN: &[u8] = include_bytes!("images/fill_sm90.fatbin");

/// Launches `fill` from `module` over `n` words with `LaunchConfig::for_elements` and checks that
/// every word, the last included, was written.
fn fill_every_element(context: &Arc<Context>, module: &Arc<Module>, n: u64) {
    let fill = module.function("fill").unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let buffer = DeviceAllocation::new(context, n as usize * 4).unwrap();
    let (dst, value) = (buffer.ptr(), 0xF111_u32);
    let args = KernelArgs::new().arg(&dst).arg(&value).arg(&n);
    let config = LaunchConfig::for_elements(n as usize, 256).unwrap();
    let mut host = vec![0u32; n as usize];
    // SAFETY: fill(unsigned*, unsigned, unsigned long long) matches the arguments; `buffer`
    // holds `n` u32s until the synchronize, and `host` is read only after it.
    unsafe {
        fill.launch(&stream, config, &args).unwrap();
        memory::copy_dtoh_async(host.as_mut_ptr().cast(), dst, n as usize * 4, &stream).unwrap();
    }
    stream.synchronize().unwrap();
    let missed = host.iter().rposition(|&word| word != value);
    assert_eq!(missed, None, "grid {:?} for {n} elements", config.grid);
}

#[test]
fn cubin_fatbin_and_unterminated_ptx_load_and_a_grid_past_65535_blocks_covers_everything() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    // 65 536 blocks of 256 and one more element: the old 65 535-block cap left the tail unwritten.
    let n = 65_536 * 256 + 1;
    let major = gpu.device.compute_capability().unwrap().major;
    if major == 9 {
        for image in [CUBIN, FATBIN] {
            let module = Module::from_cubin(context, image).unwrap();
            fill_every_element(context, &module, n);
        }
    } else {
        eprintln!("the sm_90 images do not run on compute capability {major}.x; PTX only");
    }
    // PTX bytes without a NUL are copied into a terminated buffer.
    let module = Module::from_cubin(context, PTX.as_bytes()).unwrap();
    let fill = module.function("fill_u32").unwrap();
    assert_eq!(fill.name(), "fill_u32");
    // A truncated cubin is refused before the driver reads it, and the context still works.
    for image in [
        &CUBIN[..CUBIN.len() - 1],
        &FATBIN[..100],
        b"\x7fELF garbage".as_slice(),
    ] {
        match Module::from_cubin(context, image) {
            Err(DriverError::InvalidArgument { operation, .. }) => {
                assert_eq!(operation, "Module::from_cubin");
            }
            other => panic!("a broken image gave {other:?}"),
        }
    }
}
