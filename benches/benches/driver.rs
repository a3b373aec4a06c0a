//! The raw driver costs that cuweave's upper layers must beat, measured through the driver crate.
//!
//! Each group puts the driver crate's safe handle (`cuweave/...`) beside the bare entry point
//! called through the loaded table (`raw/...`), so the report shows the wrapper's overhead and
//! the number every pool and cache above has to undercut. Timed regions, per iteration:
//!
//! | group | timed |
//! |---|---|
//! | `event_create_destroy` | `cuEventCreate` + `cuEventDestroy_v2`, timing and `DISABLE_TIMING` |
//! | `stream_create_destroy` | `cuStreamCreate(NON_BLOCKING)` + `cuStreamDestroy_v2` |
//! | `device_alloc_free_1MiB` | `cuMemAlloc_v2` + `cuMemFree_v2` of 1 MiB |
//! | `pool_async_alloc_free_1MiB` | `cuMemAllocFromPoolAsync` + `cuMemFreeAsync` of 1 MiB on a warm pool (release threshold `u64::MAX`), one stream; `amortized_sync`: one `cuStreamSynchronize` per batch of iterations, inside the timing; `sync_each`: one per iteration |
//! | `pinned_alloc_free_64MiB` | `cuMemHostAlloc(flags 0)` + `cuMemFreeHost` of 64 MiB |
//! | `poll_not_ready` | one `Event::query` / `Stream::query` that answers "pending" (the stream waits on a mapped word the host opens only after the group), beside the bare `cuEventQuery` / `cuStreamQuery` returning `CUDA_ERROR_NOT_READY`; target: the safe query within 1.2x of raw `cuEventQuery` |
//! | `memcpy_256MiB` | one synchronous `cuMemcpyHtoD_v2` / `cuMemcpyDtoH_v2` of 256 MiB, pinned or pageable host side, then `cuCtxSynchronize` (so the tail of a staged pageable copy is inside the timing); reported in GB/s (decimal, `Throughput::BytesDecimal`) |
//!
//! Host wall time (criterion's clock) throughout; nothing else runs on the device meanwhile.
//! Run with `cargo bench -p cuweave-benches --bench driver`; without a driver it prints
//! `skipping benches: no CUDA driver` and exits 0.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use cuweave_benches::{Gpu, MIB, slow_group};
use cuweave_driver::memory::{
    self, DeviceAllocation, DevicePtr, HostAllocFlags, HostAllocation, MappedWords, MemoryPool,
};
use cuweave_driver::{
    DriverApi, Event, EventFlags, Stream, StreamFlags, WaitCondition, driver, sys,
};

fn main() {
    cuweave_benches::run("driver", |c, gpu| {
        events(c, gpu);
        streams(c, gpu);
        poll_not_ready(c, gpu);
        device_alloc(c, gpu);
        pool_alloc(c, gpu);
        pinned_alloc(c, gpu);
        memcpy(c, gpu);
    });
}

/// The loaded driver table; [`cuweave_benches::run`] has already checked that it loads.
fn api() -> &'static DriverApi {
    driver().expect("the CUDA driver loaded a moment ago")
}

/// Panics with the driver's own name and text for `code` unless it is `CUDA_SUCCESS`.
fn check(code: sys::CUresult, operation: &'static str) {
    if let Err(error) = api().check(code, operation) {
        panic!("{error}");
    }
}

fn events(c: &mut Criterion, gpu: &Gpu) {
    let api = api();
    let create = api.event_create.get().expect("cuEventCreate");
    let destroy = api.event_destroy.get().expect("cuEventDestroy_v2");
    let mut group = c.benchmark_group("event_create_destroy");
    let cases = [
        (
            "timing",
            EventFlags::TIMING,
            sys::CUevent_flags::CU_EVENT_DEFAULT.0,
        ),
        (
            "disable_timing",
            EventFlags::DISABLE_TIMING,
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING.0,
        ),
    ];
    for (name, flags, raw_flags) in cases {
        group.bench_function(format!("cuweave/{name}"), |b| {
            b.iter(|| {
                drop(black_box(
                    Event::new(&gpu.context, flags).expect("Event::new"),
                ))
            });
        });
        group.bench_function(format!("raw/{name}"), |b| {
            gpu.context.bind_to_thread().expect("bind the context");
            b.iter(|| {
                let mut event = std::ptr::null_mut();
                // SAFETY: `event` is a valid out-pointer, `raw_flags` are valid CUevent_flags
                // bits, and the context is current on this (criterion's only) thread.
                check(unsafe { create(&mut event, raw_flags) }, "cuEventCreate");
                // SAFETY: `event` was created just above, nothing uses it, and it is destroyed
                // exactly once.
                check(unsafe { destroy(black_box(event)) }, "cuEventDestroy_v2");
            });
        });
    }
    group.finish();
}

fn streams(c: &mut Criterion, gpu: &Gpu) {
    let api = api();
    let create = api.stream_create.get().expect("cuStreamCreate");
    let destroy = api.stream_destroy.get().expect("cuStreamDestroy_v2");
    let mut group = c.benchmark_group("stream_create_destroy");
    group.bench_function("cuweave/non_blocking", |b| {
        b.iter(|| {
            drop(black_box(
                Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("Stream::new"),
            ));
        });
    });
    group.bench_function("raw/non_blocking", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING.0;
        b.iter(|| {
            let mut stream = std::ptr::null_mut();
            // SAFETY: `stream` is a valid out-pointer, the flags are valid, and the context is
            // current on this thread.
            check(unsafe { create(&mut stream, flags) }, "cuStreamCreate");
            // SAFETY: the stream was created just above, has no work, and is destroyed once.
            check(unsafe { destroy(black_box(stream)) }, "cuStreamDestroy_v2");
        });
    });
    group.finish();
}

fn poll_not_ready(c: &mut Criterion, gpu: &Gpu) {
    let api = api();
    let event_query = api.event_query.get().expect("cuEventQuery");
    let stream_query = api.stream_query.get().expect("cuStreamQuery");
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("Stream::new");
    let event = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).expect("Event::new");
    let gate = MappedWords::new(&gpu.context, 1).expect("MappedWords::new");
    let address = gate.device_address(0).expect("word 0");
    // SAFETY: `gate` is an aligned mapped word that outlives the wait: it is opened and the
    // stream synchronized below, before `gate` drops.
    unsafe { stream.wait_value_u64(address, 1, WaitCondition::AtLeast) }
        .expect("cuStreamWaitValue64");
    event.record(&stream).expect("Event::record");
    assert_eq!(event.query(), Ok(false), "the gate did not hold the stream");
    let not_ready = sys::CUresult::CUDA_ERROR_NOT_READY;
    let mut group = c.benchmark_group("poll_not_ready");
    group.bench_function("cuweave/Event::query", |b| {
        b.iter(|| assert!(!black_box(&event).query().expect("Event::query")));
    });
    group.bench_function("raw/cuEventQuery", |b| {
        b.iter(|| {
            // SAFETY: a live event.
            let code = unsafe { event_query(black_box(event.as_raw())) };
            assert_eq!(code, not_ready);
        });
    });
    group.bench_function("cuweave/Stream::query", |b| {
        b.iter(|| assert!(!black_box(&stream).query().expect("Stream::query")));
    });
    group.bench_function("raw/cuStreamQuery", |b| {
        b.iter(|| {
            // SAFETY: a live stream.
            let code = unsafe { stream_query(black_box(stream.as_raw())) };
            assert_eq!(code, not_ready);
        });
    });
    group.finish();
    gate.store(0, 1);
    stream.synchronize().expect("open the gate");
}

fn device_alloc(c: &mut Criterion, gpu: &Gpu) {
    let api = api();
    let alloc = api.mem_alloc.get().expect("cuMemAlloc_v2");
    let free = api.mem_free.get().expect("cuMemFree_v2");
    let mut group = c.benchmark_group("device_alloc_free_1MiB");
    group.bench_function("cuweave/DeviceAllocation", |b| {
        b.iter(|| {
            drop(black_box(
                DeviceAllocation::new(&gpu.context, MIB).expect("DeviceAllocation::new"),
            ));
        });
    });
    group.bench_function("raw/cuMemAlloc+cuMemFree", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter(|| {
            let mut ptr: DevicePtr = 0;
            // SAFETY: `ptr` is a valid out-pointer, the size is nonzero, and the context is
            // current on this thread.
            check(unsafe { alloc(&mut ptr, MIB) }, "cuMemAlloc_v2");
            // SAFETY: `ptr` came from cuMemAlloc just above, no work uses it, and it is freed once.
            check(unsafe { free(black_box(ptr)) }, "cuMemFree_v2");
        });
    });
    group.finish();
}

fn pool_alloc(c: &mut Criterion, gpu: &Gpu) {
    let api = api();
    let alloc = api
        .mem_alloc_from_pool_async
        .get()
        .expect("cuMemAllocFromPoolAsync");
    let free = api.mem_free_async.get().expect("cuMemFreeAsync");
    let pool = MemoryPool::new(&gpu.context).expect("MemoryPool::new");
    // Keep everything the pool reserves: the cached case, not a round trip to the OS each sync.
    pool.set_release_threshold(u64::MAX)
        .expect("set the pool's release threshold");
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("Stream::new");

    let raw_alloc_free = || {
        let mut ptr: DevicePtr = 0;
        // SAFETY: valid out-pointer, nonzero size, live pool and stream of the current context.
        check(
            unsafe { alloc(&mut ptr, MIB, pool.as_raw(), stream.as_raw()) },
            "cuMemAllocFromPoolAsync",
        );
        // SAFETY: `ptr` is a live stream-ordered allocation from just above, freed once on the
        // same stream; nothing else uses it.
        check(
            unsafe { free(black_box(ptr), stream.as_raw()) },
            "cuMemFreeAsync",
        );
    };
    let cuweave_alloc_free = || {
        // SAFETY: the allocation is freed on the same stream right after and never touched.
        let ptr = unsafe { pool.alloc_async(MIB, &stream) }.expect("MemoryPool::alloc_async");
        // SAFETY: `ptr` is a live stream-ordered allocation from just above, freed once.
        unsafe { memory::free_async(black_box(ptr), &stream) }.expect("free_async");
    };
    let amortized = |alloc_free: &dyn Fn(), iters: u64| -> Duration {
        let start = Instant::now();
        for _ in 0..iters {
            alloc_free();
        }
        stream.synchronize().expect("synchronize the stream");
        start.elapsed()
    };

    // Warm: the pool reserves its first block before anything is timed.
    gpu.context.bind_to_thread().expect("bind the context");
    raw_alloc_free();
    stream.synchronize().expect("synchronize the stream");

    let mut group = c.benchmark_group("pool_async_alloc_free_1MiB");
    group.bench_function("raw/amortized_sync", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter_custom(|iters| amortized(&raw_alloc_free, iters));
    });
    group.bench_function("raw/sync_each", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter(|| {
            raw_alloc_free();
            stream.synchronize().expect("synchronize the stream");
        });
    });
    group.bench_function("cuweave/amortized_sync", |b| {
        b.iter_custom(|iters| amortized(&cuweave_alloc_free, iters));
    });
    group.finish();
}

fn pinned_alloc(c: &mut Criterion, gpu: &Gpu) {
    const BYTES: usize = 64 * MIB;
    let api = api();
    let alloc = api.mem_host_alloc.get().expect("cuMemHostAlloc");
    let free = api.mem_free_host.get().expect("cuMemFreeHost");
    let mut group = c.benchmark_group("pinned_alloc_free_64MiB");
    slow_group(&mut group, Duration::from_secs(2));
    group.bench_function("cuweave/HostAllocation", |b| {
        b.iter(|| {
            drop(black_box(
                HostAllocation::new(&gpu.context, BYTES, HostAllocFlags::default())
                    .expect("HostAllocation::new"),
            ));
        });
    });
    group.bench_function("raw/cuMemHostAlloc+cuMemFreeHost", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter(|| {
            let mut ptr = std::ptr::null_mut();
            // SAFETY: `ptr` is a valid out-pointer, the size is nonzero, flags 0 are valid, and
            // the context is current on this thread.
            check(unsafe { alloc(&mut ptr, BYTES, 0) }, "cuMemHostAlloc");
            // SAFETY: `ptr` came from cuMemHostAlloc just above, is unused, and is freed once.
            check(unsafe { free(black_box(ptr)) }, "cuMemFreeHost");
        });
    });
    group.finish();
}

fn memcpy(c: &mut Criterion, gpu: &Gpu) {
    const BYTES: usize = 256 * MIB;
    let context = &gpu.context;
    let device = DeviceAllocation::new(context, BYTES).expect("allocate 256 MiB on the device");
    let mut pinned = HostAllocation::new(context, BYTES, HostAllocFlags::default())
        .expect("allocate 256 MiB of pinned host memory");
    pinned.as_bytes_mut().fill(0x5a);
    // A non-zero fill writes every page, so the pageable buffer is resident before timing.
    let mut pageable = vec![0x5au8; BYTES];
    // SAFETY: `device` is a live allocation of exactly BYTES bytes; the memset is synchronous.
    unsafe { memory::memset_d8(context, device.ptr(), 0xa5, BYTES) }.expect("memset the device");

    let finish = || context.synchronize().expect("synchronize the context");
    let mut group = c.benchmark_group("memcpy_256MiB");
    slow_group(&mut group, Duration::from_secs(2));
    group.throughput(Throughput::BytesDecimal(BYTES as u64));
    group.bench_function("h2d/pinned", |b| {
        let src = pinned.as_ptr();
        b.iter(|| {
            // SAFETY: `src` is valid for BYTES bytes (the pinned allocation, alive and unchanged
            // for the whole bench) and `device` is a live BYTES-byte device allocation.
            unsafe { memory::copy_htod(context, device.ptr(), src, BYTES) }.expect("copy_htod");
            finish();
        });
    });
    group.bench_function("h2d/pageable", |b| {
        let src = pageable.as_ptr();
        b.iter(|| {
            // SAFETY: `src` is valid for BYTES bytes (the Vec, alive and unchanged for the whole
            // bench) and `device` is a live BYTES-byte device allocation.
            unsafe { memory::copy_htod(context, device.ptr(), src, BYTES) }.expect("copy_htod");
            finish();
        });
    });
    group.bench_function("d2h/pinned", |b| {
        let dst = pinned.as_mut_ptr();
        b.iter(|| {
            // SAFETY: `dst` is valid for writes of BYTES bytes (the pinned allocation, not read
            // or otherwise borrowed during the bench) and `device` holds BYTES bytes.
            unsafe { memory::copy_dtoh(context, dst, device.ptr(), BYTES) }.expect("copy_dtoh");
            finish();
        });
    });
    group.bench_function("d2h/pageable", |b| {
        let dst = pageable.as_mut_ptr();
        b.iter(|| {
            // SAFETY: `dst` is valid for writes of BYTES bytes (the Vec, not read or otherwise
            // borrowed during the bench) and `device` holds BYTES bytes.
            unsafe { memory::copy_dtoh(context, dst, device.ptr(), BYTES) }.expect("copy_dtoh");
            finish();
        });
    });
    group.finish();
    // The copies are synchronous and finished; the buffers may go.
    drop((device, pinned, pageable));
}
