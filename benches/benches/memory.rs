//! cuweave-memory against the raw driver calls it replaces, side by side in one run.
//!
//! Timed regions, per iteration:
//!
//! | group / id | timed |
//! |---|---|
//! | `alloc_free_1MiB/cuweave/CachingAllocator` | `CachingAllocator::allocate(1 MiB, stream)` + dropping the allocation; warm (the 2 MiB segment is cached before timing), always the same stream, so every iteration is a cache hit and no driver call |
//! | `alloc_free_1MiB/raw/cuMemAllocFromPoolAsync+cuMemFreeAsync` | the cached stream-ordered pool: both calls on one stream, on a pool with release threshold `u64::MAX`, warm; one `cuStreamSynchronize` per batch of iterations, inside the timing (amortized) |
//! | `alloc_free_1MiB/cuweave/AsyncPoolResource` | the same pool through `MemoryResource::allocate` + `deallocate`, amortized alike |
//! | `alloc_free_1MiB/raw/cuMemAlloc+cuMemFree` | `cuMemAlloc_v2` + `cuMemFree_v2` of 1 MiB |
//! | `alloc_free_1MiB/cuweave/DeviceBuffer::new_on` | the safe typed path: `DeviceBuffer::<u8>::new_on(&stream, 1 MiB)` + drop, from the device's default caching allocator (warm), nothing queued on it |
//! | `drop_during_kernel_1MiB/cuweave/DeviceBuffer` | dropping a 1 MiB `DeviceBuffer` (from `new_on(&b)`) right after a `fill_async` of it on stream `b`, while a 300 ms kernel runs on stream `a`; only the drop is timed (the allocation and the fill are not); a new 300 ms kernel is launched whenever the last one finished |
//! | `typed_threads_1MiB/{1,16}` | as `caching_threads_1MiB/sharded`, each thread making and dropping `DeviceBuffer::<u8>::new_on(&its_stream, 1 MiB)` on the default allocator |
//! | `caching_threads_1MiB/sharded/{1,4,16}` | each of N threads, on its own stream, does `iters` alloc+free of 1 MiB (warm: every thread's segment is cached before timing) on one shared `CachingAllocator` (32 shards); the time is the slowest thread's, from a common start (a barrier) to its last free, so it reads as *time per alloc+free per thread*; N threads together do N times the iterations |
//! | `caching_threads_1MiB/one_lock/{1,4,16}` | the same on `CachingAllocator::with_shards(.., 1)`: every stream under one lock and one shared handle, as the allocator was before sharding |
//! | `fill_4KiB/cuweave/fill_async` | `DeviceBuffer::<u32>::fill_async` of 4 KiB, always on the stream that used the buffer last (the tracked path: no cross-stream wait, the stream's event re-recorded); one `cuStreamSynchronize` per batch, inside the timing |
//! | `fill_4KiB/raw/cuMemsetD32Async` | the same memset through the driver's function pointer, on the same stream, synchronised alike |
//! | `pinned_get_return_16MiB/cuweave/PinnedPool` | `PinnedPool::get(16 MiB)` + dropping the block (no recorded stream, so it is ready again at once); warm |
//! | `pinned_get_return_16MiB/raw/cuMemHostAlloc+cuMemFreeHost` | the same 16 MiB pinned (`PORTABLE`, as the pool pins) and freed |
//! | `managed_checksum_512MiB/kernel_after_prefetch` | device time (timing events) of one `checksum_u32` kernel over a 512 MiB `UnifiedBuffer<u32>` whose pages a `PrefetchPlan` moved to the device before the start event |
//! | `managed_checksum_512MiB/prefetch_plus_kernel` | device time of `PrefetchPlan::execute` (512 MiB, host to device) and the same kernel, both between the events |
//! | `managed_checksum_512MiB/kernel_on_demand` | device time of the same kernel while every page is on the host, so the kernel faults them in |
//!
//! Before each managed iteration, untimed: the buffer is prefetched to the host and the stream
//! synchronised (every case starts with all 512 MiB on the host), and the kernel's 8-byte output
//! is zeroed; after it, untimed: the checksum is read back and must equal the element count (the
//! buffer holds ones), so every case did the same, complete work. Managed memory in this bench is
//! that one buffer of exactly 512 MiB.
//!
//! After criterion's report, under `--bench`, summary lines re-measure (median of five
//! batches, host clock) the caching allocator against its targets: at most 0.15 µs per
//! alloc+free, and at least ten times faster than the cached `cuMemAllocAsync` pool, measured
//! side by side; with 16 threads on 16 streams at most 150 ns per alloc+free per thread and at
//! least 8 times one thread's throughput; and tracked `fill_async` within 1.2 times the raw
//! memset; the safe typed buffer at most 0.15 µs, within 1.5 times the raw allocator path and at
//! least 400 times `cuMemAlloc` + `cuMemFree`; its drop under a 300 ms kernel of another stream
//! at most 50 µs (`cuMemAlloc` + memset + `cuMemFree` measured the same way, once); 16 threads of
//! typed buffers at most 200 ns per op per thread.
//!
//! Run with `cargo bench -p cuweave-benches --bench memory`; without a driver it prints
//! `skipping benches: no CUDA driver` and exits 0.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use cuweave_benches::{Gpu, GpuTimer, MIB, measuring, median_per_iteration, slow_group};
use cuweave_driver::memory::{self, DeviceAllocation, DevicePtr, MemoryPool};
use cuweave_driver::{Context, DriverApi, Stream, StreamFlags, driver, sys};
use cuweave_memory::DeviceBuffer;
use cuweave_memory::buffer::{Buffer, UnifiedBuffer};
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::pinned_pool::PinnedPool;
use cuweave_memory::resource::DriverResource;
use cuweave_memory::resource::{AsyncPoolResource, MemoryResource};
use cuweave_memory::unified::{MemLocation, PrefetchPlan};
use cuweave_test_support::kernels::TestKernels;

/// The caching allocator's targets (issue 3): time per alloc+free, and speed-up over the pool.
const CACHING_TARGET_US: f64 = 0.15;
const CACHING_TARGET_SPEEDUP: f64 = 10.0;
/// The scaling targets (issue 9): per-thread time at 16 threads, and 16 threads' throughput over
/// one thread's.
const THREADS_TARGET_NS: f64 = 150.0;
const THREADS_TARGET_SCALING: f64 = 8.0;
/// Tracked fill against the raw memset (issue 9).
const FILL_TARGET_RATIO: f64 = 1.2;
/// The typed buffer's targets (issue 14): time per new_on+drop, ratio to the raw caching path,
/// speed-up over cuMemAlloc+cuMemFree, drop under another stream's kernel, 16 threads.
const TYPED_TARGET_US: f64 = 0.15;
const TYPED_TARGET_RATIO: f64 = 1.5;
const TYPED_TARGET_SPEEDUP: f64 = 400.0;
const DROP_TARGET_US: f64 = 50.0;
const TYPED_THREADS_TARGET_NS: f64 = 200.0;
/// The unrelated kernel a drop must not wait for.
const LONG_KERNEL_NS: u64 = 300_000_000;
/// Thread counts of the scaling bench.
const THREAD_COUNTS: [usize; 3] = [1, 4, 16];

fn main() {
    cuweave_benches::run("memory", |c, gpu| {
        let allocators = Allocators::new(gpu);
        alloc_free(c, &allocators);
        let sharded = Threaded::new(gpu, 32);
        let one_lock = Threaded::new(gpu, 1);
        threads(c, &sharded, &one_lock);
        let fills = Fills::new(gpu);
        fill(c, &fills);
        let typed_threads = TypedThreads::new(gpu);
        typed(c, &allocators, &typed_threads);
        let drops = Drops::new(gpu);
        drop_during_kernel(c, &drops);
        pinned(c, gpu);
        managed(c, gpu);
        if measuring() {
            summary(&allocators);
            typed_summary(&allocators, &typed_threads, &drops);
            threads_summary(&sharded, &one_lock);
            fill_summary(&fills);
        }
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

/// The four 1 MiB alloc+free paths, each as an `iter_custom` routine (iterations in, host time
/// out) so criterion and the summary time exactly the same loops.
struct Allocators {
    // Field order is drop order: the caching allocator and the pools go before their stream.
    caching: CachingAllocator,
    resource: AsyncPoolResource,
    pool: MemoryPool,
    stream: Stream,
    context: std::sync::Arc<Context>,
}

impl Allocators {
    fn new(gpu: &Gpu) -> Self {
        let context = std::sync::Arc::clone(&gpu.context);
        let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).expect("Stream::new");
        let pool = MemoryPool::new(&context).expect("MemoryPool::new");
        // Keep everything the pool reserves: the cached case.
        pool.set_release_threshold(u64::MAX)
            .expect("set the pool's release threshold");
        let this = Self {
            caching: CachingAllocator::with_driver(&context),
            resource: AsyncPoolResource::new(&context).expect("AsyncPoolResource::new"),
            pool,
            stream,
            context,
        };
        // Warm every cache before anything is timed.
        this.caching(1);
        this.raw_pool(1);
        this.resource(1);
        this.typed(1);
        assert_eq!(
            this.caching.stats().cache_misses,
            1,
            "only the warm-up allocation reaches the driver"
        );
        this
    }

    fn caching(&self, iters: u64) -> Duration {
        let start = Instant::now();
        for _ in 0..iters {
            let allocation = self
                .caching
                .allocate(MIB, &self.stream)
                .expect("CachingAllocator::allocate");
            drop(black_box(allocation));
        }
        start.elapsed()
    }

    fn typed(&self, iters: u64) -> Duration {
        let start = Instant::now();
        for _ in 0..iters {
            let buffer =
                DeviceBuffer::<u8>::new_on(&self.stream, MIB).expect("DeviceBuffer::new_on");
            drop(black_box(buffer));
        }
        start.elapsed()
    }

    fn raw_pool(&self, iters: u64) -> Duration {
        let api = api();
        let alloc = api
            .mem_alloc_from_pool_async
            .get()
            .expect("cuMemAllocFromPoolAsync");
        let free = api.mem_free_async.get().expect("cuMemFreeAsync");
        self.context.bind_to_thread().expect("bind the context");
        let (pool, stream) = (self.pool.as_raw(), self.stream.as_raw());
        let start = Instant::now();
        for _ in 0..iters {
            let mut ptr: DevicePtr = 0;
            // SAFETY: valid out-pointer, nonzero size, live pool and stream of the current context.
            check(
                unsafe { alloc(&mut ptr, MIB, pool, stream) },
                "cuMemAllocFromPoolAsync",
            );
            // SAFETY: `ptr` is a live stream-ordered allocation from just above, freed once on the
            // same stream; nothing uses it.
            check(unsafe { free(black_box(ptr), stream) }, "cuMemFreeAsync");
        }
        self.stream.synchronize().expect("synchronize the stream");
        start.elapsed()
    }

    fn resource(&self, iters: u64) -> Duration {
        let start = Instant::now();
        for _ in 0..iters {
            let ptr = self
                .resource
                .allocate(MIB, &self.stream)
                .expect("AsyncPoolResource::allocate");
            self.resource
                .deallocate(black_box(ptr), MIB, &self.stream)
                .expect("AsyncPoolResource::deallocate");
        }
        self.stream.synchronize().expect("synchronize the stream");
        start.elapsed()
    }

    fn raw_alloc(&self, iters: u64) -> Duration {
        let api = api();
        let alloc = api.mem_alloc.get().expect("cuMemAlloc_v2");
        let free = api.mem_free.get().expect("cuMemFree_v2");
        self.context.bind_to_thread().expect("bind the context");
        let start = Instant::now();
        for _ in 0..iters {
            let mut ptr: DevicePtr = 0;
            // SAFETY: valid out-pointer, nonzero size, and the context is current on this thread.
            check(unsafe { alloc(&mut ptr, MIB) }, "cuMemAlloc_v2");
            // SAFETY: `ptr` came from cuMemAlloc just above, no work uses it, and it is freed once.
            check(unsafe { free(black_box(ptr)) }, "cuMemFree_v2");
        }
        start.elapsed()
    }
}

fn alloc_free(c: &mut Criterion, allocators: &Allocators) {
    let mut group = c.benchmark_group("alloc_free_1MiB");
    group.bench_function("cuweave/CachingAllocator", |b| {
        b.iter_custom(|iters| allocators.caching(iters));
    });
    group.bench_function("raw/cuMemAllocFromPoolAsync+cuMemFreeAsync", |b| {
        b.iter_custom(|iters| allocators.raw_pool(iters));
    });
    group.bench_function("cuweave/AsyncPoolResource", |b| {
        b.iter_custom(|iters| allocators.resource(iters));
    });
    group.bench_function("raw/cuMemAlloc+cuMemFree", |b| {
        b.iter_custom(|iters| allocators.raw_alloc(iters));
    });
    group.finish();
}

fn pinned(c: &mut Criterion, gpu: &Gpu) {
    const BYTES: usize = 16 * MIB;
    let pool = PinnedPool::new(&gpu.context);
    // Warm: the one 16 MiB block is pinned before timing, then reused.
    drop(pool.get(BYTES).expect("PinnedPool::get"));
    let api = api();
    let alloc = api.mem_host_alloc.get().expect("cuMemHostAlloc");
    let free = api.mem_free_host.get().expect("cuMemFreeHost");

    let mut group = c.benchmark_group("pinned_get_return_16MiB");
    group.bench_function("cuweave/PinnedPool", |b| {
        b.iter(|| drop(black_box(pool.get(BYTES).expect("PinnedPool::get"))));
    });
    slow_group(&mut group, Duration::from_secs(2));
    group.bench_function("raw/cuMemHostAlloc+cuMemFreeHost", |b| {
        gpu.context.bind_to_thread().expect("bind the context");
        b.iter(|| {
            let mut ptr = std::ptr::null_mut();
            // SAFETY: valid out-pointer, nonzero size, valid flags, and the context is current.
            check(
                unsafe { alloc(&mut ptr, BYTES, sys::CU_MEMHOSTALLOC_PORTABLE) },
                "cuMemHostAlloc",
            );
            // SAFETY: `ptr` came from cuMemHostAlloc just above, is unused, and is freed once.
            check(unsafe { free(black_box(ptr)) }, "cuMemFreeHost");
        });
    });
    group.finish();
    assert_eq!(pool.stats().misses, 1, "only the warm-up get pinned memory");
}

fn managed(c: &mut Criterion, gpu: &Gpu) {
    // GPU safety rule: managed memory stays at or under 1 GiB; this is the only managed buffer.
    const BYTES: usize = 512 * MIB;
    const LEN: usize = BYTES / size_of::<u32>();
    let context = &gpu.context;
    let on_device = MemLocation::Device(gpu.device.ordinal());
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).expect("Stream::new");
    let kernels = TestKernels::load(context).expect("load the test kernels");
    let mut data = UnifiedBuffer::<u32>::new(context, LEN).expect("allocate 512 MiB managed");
    assert_eq!(data.byte_size(), BYTES);
    data.fill(1).expect("fill the managed buffer");
    let out = DeviceAllocation::new(context, size_of::<u64>()).expect("allocate the checksum");
    let mut plan = PrefetchPlan::new();
    plan.add(&data, on_device).expect("PrefetchPlan::add");
    let timer = GpuTimer::new(gpu);

    // Untimed, before every iteration: all pages back on the host, and the output zeroed.
    let reset = || {
        data.prefetch_to(MemLocation::Host, &stream)
            .expect("prefetch to the host");
        // SAFETY: `out` is a live 8-byte device allocation, written only by the kernels below,
        // which run after this on the same stream.
        unsafe { memory::memset_d8_async(out.ptr(), 0, size_of::<u64>(), &stream) }
            .expect("zero the checksum");
        stream.synchronize().expect("synchronize the stream");
    };
    let checksum = || {
        // SAFETY: `data` holds LEN u32s and `out` one u64; both outlive the kernel, which
        // `GpuTimer::time` waits for before `verify` or the next `reset` touches them.
        unsafe { kernels.checksum_u32(&stream, data.device_ptr(), LEN, out.ptr()) }
            .expect("launch checksum_u32");
    };
    // Untimed, after every iteration: the kernel read every element (all ones).
    let verify = || {
        data.record_use(&stream).expect("record the kernel's use");
        let mut sum = 0u64;
        // SAFETY: `sum` is 8 writable bytes and `out` 8 device bytes; the kernel that wrote
        // `out` has finished (its stop event was waited for).
        unsafe { memory::copy_dtoh(context, (&raw mut sum).cast(), out.ptr(), size_of::<u64>()) }
            .expect("read the checksum");
        assert_eq!(sum, LEN as u64, "the kernel must read all 512 MiB");
    };
    let run = |iters: u64, timed: &dyn Fn() -> Duration| {
        (0..iters)
            .map(|_| {
                reset();
                let elapsed = timed();
                verify();
                elapsed
            })
            .sum::<Duration>()
    };

    reset();
    let path = plan.execute(&stream).expect("PrefetchPlan::execute");
    stream.synchronize().expect("synchronize the stream");
    println!("managed_checksum_512MiB: PrefetchPlan issues its prefetch {path}");

    let mut group = c.benchmark_group("managed_checksum_512MiB");
    slow_group(&mut group, Duration::from_secs(3));
    group.throughput(Throughput::BytesDecimal(BYTES as u64));
    group.bench_function("kernel_after_prefetch", |b| {
        b.iter_custom(|iters| {
            run(iters, &|| {
                plan.execute(&stream).expect("PrefetchPlan::execute");
                stream.synchronize().expect("synchronize the stream");
                timer.time(&stream, checksum)
            })
        });
    });
    group.bench_function("prefetch_plus_kernel", |b| {
        b.iter_custom(|iters| {
            run(iters, &|| {
                timer.time(&stream, || {
                    plan.execute(&stream).expect("PrefetchPlan::execute");
                    checksum();
                })
            })
        });
    });
    group.bench_function("kernel_on_demand", |b| {
        b.iter_custom(|iters| run(iters, &|| timer.time(&stream, checksum)));
    });
    group.finish();
}

fn summary(allocators: &Allocators) {
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let caching = micros(median_per_iteration(5, 200_000, |n| allocators.caching(n)));
    let pool = micros(median_per_iteration(5, 20_000, |n| allocators.raw_pool(n)));
    let raw = micros(median_per_iteration(5, 100, |n| allocators.raw_alloc(n)));
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    let speedup = pool / caching;
    println!();
    println!(
        "summary: 1 MiB alloc+free, median of 5 batches, host clock (separate from criterion)"
    );
    println!(
        "  CachingAllocator                 {caching:>9.3} µs  target <= {CACHING_TARGET_US} µs: {}",
        verdict(caching <= CACHING_TARGET_US)
    );
    println!(
        "  cached cuMemAllocAsync pool      {pool:>9.3} µs  caching allocator {speedup:.1}x faster, target >= {CACHING_TARGET_SPEEDUP}x: {}",
        verdict(speedup >= CACHING_TARGET_SPEEDUP)
    );
    println!(
        "  cuMemAlloc + cuMemFree           {raw:>9.3} µs  caching allocator {:.0}x faster",
        raw / caching
    );
}

/// One shared caching allocator and 16 streams, one per thread, every stream's 1 MiB block
/// cached before timing.
struct Threaded {
    allocator: CachingAllocator,
    streams: Vec<Stream>,
}

impl Threaded {
    fn new(gpu: &Gpu, shards: usize) -> Self {
        let context = &gpu.context;
        let allocator =
            CachingAllocator::with_shards(Arc::new(DriverResource::new(context)), shards);
        let streams: Vec<Stream> = (0..16)
            .map(|_| Stream::new(context, StreamFlags::NON_BLOCKING).expect("Stream::new"))
            .collect();
        for stream in &streams {
            drop(allocator.allocate(MIB, stream).expect("warm a stream"));
        }
        assert_eq!(
            allocator.stats().cache_misses,
            16,
            "one segment per stream, before timing"
        );
        Self { allocator, streams }
    }

    /// `threads` threads each do `iters` alloc+free on their own stream; returns the slowest
    /// thread's time from the common start.
    fn run(&self, threads: usize, iters: u64) -> Duration {
        on_threads(&self.streams[..threads], iters, |stream| {
            let block = self.allocator.allocate(MIB, stream).expect("allocate");
            drop(black_box(block));
        })
    }
}

/// One thread per stream, each running `op` on its stream `iters` times (once before the clock,
/// which binds the context); returns the slowest thread's time from a common start (a barrier).
fn on_threads(streams: &[Stream], iters: u64, op: impl Fn(&Stream) + Sync) -> Duration {
    let start = Barrier::new(streams.len());
    std::thread::scope(|scope| {
        let workers: Vec<_> = streams
            .iter()
            .map(|stream| {
                let (start, op) = (&start, &op);
                scope.spawn(move || {
                    op(stream);
                    start.wait();
                    let begin = Instant::now();
                    for _ in 0..iters {
                        op(stream);
                    }
                    begin.elapsed()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|worker| worker.join().expect("bench thread"))
            .max()
            .unwrap_or_default()
    })
}

fn threads(c: &mut Criterion, sharded: &Threaded, one_lock: &Threaded) {
    let mut group = c.benchmark_group("caching_threads_1MiB");
    for count in THREAD_COUNTS {
        group.bench_function(format!("sharded/{count}"), |b| {
            b.iter_custom(|iters| sharded.run(count, iters));
        });
    }
    for count in THREAD_COUNTS {
        group.bench_function(format!("one_lock/{count}"), |b| {
            b.iter_custom(|iters| one_lock.run(count, iters));
        });
    }
    group.finish();
    let stats = sharded.allocator.stats();
    assert_eq!(
        stats.cache_misses, 16,
        "every timed allocation was a cache hit"
    );
}

/// A 4 KiB device buffer and a stream, for the tracked fill against the raw memset.
struct Fills {
    buffer: std::cell::RefCell<DeviceBuffer<u32>>,
    raw: DeviceAllocation,
    stream: Stream,
    context: Arc<Context>,
}

const FILL_WORDS: usize = 1024;

impl Fills {
    fn new(gpu: &Gpu) -> Self {
        let context = Arc::clone(&gpu.context);
        let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).expect("Stream::new");
        let buffer = DeviceBuffer::<u32>::zeroed(&context, FILL_WORDS).expect("buffer");
        let raw = DeviceAllocation::new(&context, FILL_WORDS * 4).expect("raw allocation");
        let this = Self {
            buffer: std::cell::RefCell::new(buffer),
            raw,
            stream,
            context,
        };
        this.tracked(1);
        this.raw(1);
        this
    }

    fn tracked(&self, iters: u64) -> Duration {
        let mut buffer = self.buffer.borrow_mut();
        let start = Instant::now();
        for i in 0..iters {
            buffer
                .fill_async(black_box(i as u32), &self.stream)
                .expect("fill_async");
        }
        self.stream.synchronize().expect("synchronize");
        start.elapsed()
    }

    fn raw(&self, iters: u64) -> Duration {
        let memset = api().memset_d32_async.get().expect("cuMemsetD32Async");
        self.context.bind_to_thread().expect("bind the context");
        let (ptr, stream) = (self.raw.ptr(), self.stream.as_raw());
        let start = Instant::now();
        for i in 0..iters {
            // SAFETY: `ptr` is a live allocation of FILL_WORDS words, used by nothing else.
            check(
                unsafe { memset(ptr, black_box(i as u32), FILL_WORDS, stream) },
                "cuMemsetD32Async",
            );
        }
        self.stream.synchronize().expect("synchronize");
        start.elapsed()
    }
}

fn fill(c: &mut Criterion, fills: &Fills) {
    let mut group = c.benchmark_group("fill_4KiB");
    group.bench_function("cuweave/fill_async", |b| {
        b.iter_custom(|iters| fills.tracked(iters));
    });
    group.bench_function("raw/cuMemsetD32Async", |b| {
        b.iter_custom(|iters| fills.raw(iters));
    });
    group.finish();
    let buffer = fills.buffer.borrow();
    assert_eq!(buffer.last_use(), Some(fills.stream.as_raw() as usize));
}

fn threads_summary(sharded: &Threaded, one_lock: &Threaded) {
    let nanos = |d: Duration| d.as_secs_f64() * 1e9;
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    println!();
    println!(
        "summary: 1 MiB alloc+free per thread, each thread on its own stream, one shared \
         allocator, median of 5 batches"
    );
    let mut per_thread = Vec::new();
    // The one-lock allocator takes microseconds per operation under contention: fewer iterations.
    for (name, bench, iters) in [
        ("sharded (32 shards)", sharded, 200_000),
        ("one lock", one_lock, 10_000),
    ] {
        let times: Vec<f64> = THREAD_COUNTS
            .iter()
            .map(|&count| nanos(median_per_iteration(5, iters, |n| bench.run(count, n))))
            .collect();
        println!(
            "  {name:<20} 1 thread {:>8.1} ns   4 threads {:>8.1} ns   16 threads {:>9.1} ns per op per thread",
            times[0], times[1], times[2]
        );
        per_thread.push(times);
    }
    let sharded = &per_thread[0];
    let scaling = 16.0 * sharded[0] / sharded[2];
    println!(
        "  sharded: 16 threads {:.1} ns per op per thread, target <= {THREADS_TARGET_NS} ns: {}",
        sharded[2],
        verdict(sharded[2] <= THREADS_TARGET_NS)
    );
    println!(
        "  sharded: 16 threads do {scaling:.1}x one thread's alloc+frees per second, target >= {THREADS_TARGET_SCALING}x: {}",
        verdict(scaling >= THREADS_TARGET_SCALING)
    );
}

fn fill_summary(fills: &Fills) {
    let micros = |d: Duration| d.as_secs_f64() * 1e6;
    let tracked = micros(median_per_iteration(5, 20_000, |n| fills.tracked(n)));
    let raw = micros(median_per_iteration(5, 20_000, |n| fills.raw(n)));
    let ratio = tracked / raw;
    println!();
    println!("summary: 4 KiB fill on one stream, median of 5 batches, host clock");
    println!(
        "  DeviceBuffer::fill_async {tracked:>7.3} µs   raw cuMemsetD32Async {raw:>7.3} µs   ratio {ratio:.2}, target <= {FILL_TARGET_RATIO}: {}",
        if ratio <= FILL_TARGET_RATIO {
            "met"
        } else {
            "MISSED"
        }
    );
}

fn typed(c: &mut Criterion, allocators: &Allocators, threads: &TypedThreads) {
    let mut group = c.benchmark_group("alloc_free_1MiB");
    group.bench_function("cuweave/DeviceBuffer::new_on", |b| {
        b.iter_custom(|iters| allocators.typed(iters));
    });
    group.finish();
    let mut group = c.benchmark_group("typed_threads_1MiB");
    for count in [1, 16] {
        group.bench_function(format!("{count}"), |b| {
            b.iter_custom(|iters| threads.run(count, iters));
        });
    }
    group.finish();
}

/// 16 streams, one per thread, each making and dropping typed buffers on the default allocator.
struct TypedThreads {
    streams: Vec<Stream>,
}

impl TypedThreads {
    fn new(gpu: &Gpu) -> Self {
        let streams: Vec<Stream> = (0..16)
            .map(|_| Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("Stream::new"))
            .collect();
        for stream in &streams {
            drop(DeviceBuffer::<u8>::new_on(stream, MIB).expect("warm a stream"));
        }
        Self { streams }
    }

    /// `threads` threads each make and drop `iters` buffers on their own stream; returns the
    /// slowest thread's time from the common start.
    fn run(&self, threads: usize, iters: u64) -> Duration {
        on_threads(&self.streams[..threads], iters, |stream| {
            let buffer = DeviceBuffer::<u8>::new_on(stream, MIB).expect("new_on");
            drop(black_box(buffer));
        })
    }
}

/// Two streams and the spin kernel: drops on `b` while `a` runs a long kernel.
struct Drops {
    kernels: TestKernels,
    a: Stream,
    b: Stream,
    context: Arc<Context>,
}

impl Drops {
    fn new(gpu: &Gpu) -> Self {
        let context = Arc::clone(&gpu.context);
        let new_stream = || Stream::new(&context, StreamFlags::NON_BLOCKING).expect("Stream::new");
        let (a, b) = (new_stream(), new_stream());
        Self {
            kernels: TestKernels::load(&context).expect("load the test kernels"),
            a,
            b,
            context,
        }
    }

    /// Keeps a 300 ms kernel running on `a`.
    fn keep_busy(&self) {
        if self.a.query().expect("query a") {
            self.kernels
                .spin_ns(&self.a, LONG_KERNEL_NS)
                .expect("launch the long kernel");
        }
    }

    /// `iters` times: a buffer on `b`, filled there, dropped; only the drops are timed.
    fn typed(&self, iters: u64) -> Duration {
        let mut timed = Duration::ZERO;
        for _ in 0..iters {
            self.keep_busy();
            let mut buffer = DeviceBuffer::<u8>::new_on(&self.b, MIB).expect("new_on");
            buffer.fill_async(7, &self.b).expect("fill_async");
            let start = Instant::now();
            drop(black_box(buffer));
            timed += start.elapsed();
        }
        timed
    }

    /// The raw path measured the same way: `cuMemAlloc`, a memset on `b`, then `cuMemFree`
    /// (timed), which waits for the whole device.
    fn raw(&self) -> Duration {
        self.keep_busy();
        let allocation = DeviceAllocation::new(&self.context, MIB).expect("cuMemAlloc");
        // SAFETY: a live allocation of MIB bytes, freed below after the memset (cuMemFree waits
        // for the device).
        unsafe { memory::memset_d8_async(allocation.ptr(), 7, MIB, &self.b) }.expect("memset");
        let start = Instant::now();
        allocation.free().expect("cuMemFree");
        start.elapsed()
    }
}

fn drop_during_kernel(c: &mut Criterion, drops: &Drops) {
    let mut group = c.benchmark_group("drop_during_kernel_1MiB");
    group.bench_function("cuweave/DeviceBuffer", |b| {
        b.iter_custom(|iters| drops.typed(iters));
    });
    group.finish();
    drops.a.synchronize().expect("synchronize a");
}

fn typed_summary(allocators: &Allocators, threads: &TypedThreads, drops: &Drops) {
    let nanos = |d: Duration| d.as_secs_f64() * 1e9;
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    let typed = nanos(median_per_iteration(5, 200_000, |n| allocators.typed(n)));
    let caching = nanos(median_per_iteration(5, 200_000, |n| allocators.caching(n)));
    let raw = nanos(median_per_iteration(5, 100, |n| allocators.raw_alloc(n)));
    let (ratio, speedup) = (typed / caching, raw / typed);
    println!();
    println!("summary: safe 1 MiB DeviceBuffer::new_on + drop, median of 5 batches, host clock");
    println!(
        "  DeviceBuffer::new_on + drop      {typed:>9.1} ns  target <= {} ns: {}",
        TYPED_TARGET_US * 1e3,
        verdict(typed <= TYPED_TARGET_US * 1e3)
    );
    println!(
        "  raw CachingAllocator             {caching:>9.1} ns  ratio {ratio:.2}, target <= {TYPED_TARGET_RATIO}: {}",
        verdict(ratio <= TYPED_TARGET_RATIO)
    );
    println!(
        "  cuMemAlloc + cuMemFree           {raw:>9.1} ns  typed buffer {speedup:.0}x faster, target >= {TYPED_TARGET_SPEEDUP}x: {}",
        verdict(speedup >= TYPED_TARGET_SPEEDUP)
    );
    let per_thread =
        [1, 16].map(|count| nanos(median_per_iteration(5, 200_000, |n| threads.run(count, n))));
    println!(
        "  typed buffers, 1 thread {:.1} ns, 16 threads {:.1} ns per op per thread, target <= {TYPED_THREADS_TARGET_NS} ns: {}",
        per_thread[0],
        per_thread[1],
        verdict(per_thread[1] <= TYPED_THREADS_TARGET_NS)
    );
    drops.a.synchronize().expect("synchronize a");
    let drop_us = median_per_iteration(5, 1_000, |n| drops.typed(n)).as_secs_f64() * 1e6;
    let raw_drop_ms = drops.raw().as_secs_f64() * 1e3;
    drops.a.synchronize().expect("synchronize a");
    println!(
        "  drop during a 300 ms kernel on another stream: DeviceBuffer {drop_us:.2} µs, target <= {DROP_TARGET_US} µs: {}; cuMemFree {raw_drop_ms:.1} ms",
        verdict(drop_us <= DROP_TARGET_US)
    );
}
