//! Memory resources on a real GPU: each round-trips data, checks what it is given back, and the
//! async pool keeps what is freed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cuweave_driver::memory::{self, DevicePtr};
use cuweave_driver::{Context, Stream, StreamFlags};
use cuweave_memory::resource::{
    AsyncPoolResource, DriverResource, LOG_HEADER, LimitAdaptor, LoggingAdaptor, MemoryResource,
    StatisticsAdaptor, TrackingAdaptor,
};
use cuweave_memory::{Buffer, DeviceBuffer, MemoryError};
use cuweave_test_support::require_gpu;

const MIB: usize = 1 << 20;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// Allocates two buffers from `resource`, uploads a pattern into one, copies it to the other on
/// the device, downloads and compares, then frees both: the memory is real and usable.
fn round_trip(resource: &dyn MemoryResource, stream: &Stream) {
    let words = MIB / 4;
    let pattern: Vec<u32> = (0..words as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let src = resource.allocate(MIB, stream).unwrap();
    let dst = resource.allocate(MIB, stream).unwrap();
    assert_ne!(src, dst);
    let mut back = vec![0u32; words];
    // SAFETY: both device ranges are MIB bytes and live until the deallocations below, which
    // are queued after the copies on the same stream; `pattern` and `back` outlive the
    // synchronisation that ends the copies.
    unsafe {
        memory::memset_d32_async(dst, 0, words, stream).unwrap();
        memory::copy_htod_async(src, pattern.as_ptr().cast(), MIB, stream).unwrap();
        memory::copy_dtod_async(dst, src, MIB, stream).unwrap();
        memory::copy_dtoh_async(back.as_mut_ptr().cast(), dst, MIB, stream).unwrap();
    }
    stream.synchronize().unwrap();
    assert!(
        back == pattern,
        "{}: data survived upload, device copy and download",
        resource.name()
    );
    resource.deallocate(src, MIB, stream).unwrap();
    resource.deallocate(dst, MIB, stream).unwrap();
}

/// Bad frees are typed errors and leave the allocation intact.
fn rejects_bad_input(resource: &dyn MemoryResource, stream: &Stream) {
    assert!(matches!(
        resource.allocate(0, stream),
        Err(MemoryError::ZeroLength { .. })
    ));
    let ptr: DevicePtr = resource.allocate(4096, stream).unwrap();
    assert!(matches!(
        resource.deallocate(ptr, 512, stream),
        Err(MemoryError::SizeMismatch {
            expected: 4096,
            actual: 512,
            ..
        })
    ));
    assert!(matches!(
        resource.deallocate(ptr + 1, 4096, stream),
        Err(MemoryError::UnknownAllocation { .. })
    ));
    resource.deallocate(ptr, 4096, stream).unwrap();
    assert!(
        matches!(
            resource.deallocate(ptr, 4096, stream),
            Err(MemoryError::UnknownAllocation { ptr: p, .. }) if p == ptr
        ),
        "a second free is refused, not passed to the driver"
    );
}

#[test]
fn driver_resource_round_trips_and_checks_its_frees() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let resource = DriverResource::new(&gpu.context);
    round_trip(&resource, &s);
    rejects_bad_input(&resource, &s);
    assert_eq!(resource.outstanding(), 0);
    assert_eq!(resource.device(), gpu.device);
}

#[test]
fn async_pool_resource_round_trips_and_keeps_freed_memory() {
    let gpu = require_gpu!();
    if !gpu.device.supports_memory_pools().unwrap() {
        eprintln!("device lacks memory pools; AsyncPoolResource::new must say so");
        assert!(AsyncPoolResource::new(&gpu.context).is_err());
        return;
    }
    let s = stream(&gpu.context);
    let resource = AsyncPoolResource::new(&gpu.context).unwrap();
    assert_eq!(resource.pool().release_threshold().unwrap(), u64::MAX);
    round_trip(&resource, &s);
    rejects_bad_input(&resource, &s);
    s.synchronize().unwrap();
    assert_eq!(resource.outstanding(), 0);
    let pool = resource.pool();
    assert_eq!(pool.used_bytes().unwrap(), 0, "everything was freed");
    assert!(
        pool.reserved_bytes().unwrap() >= 2 * MIB as u64,
        "the pool keeps the freed memory even after a synchronisation"
    );
    // Kept memory is reused: another megabyte needs no more reservation.
    let reserved = pool.reserved_bytes().unwrap();
    let ptr = resource.allocate(MIB, &s).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), reserved);
    resource.deallocate(ptr, MIB, &s).unwrap();
    s.synchronize().unwrap();
}

#[test]
fn statistics_adaptor_counts_what_passes_through() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let upstream: Arc<dyn MemoryResource> = Arc::new(DriverResource::new(&gpu.context));
    let counted = StatisticsAdaptor::new(upstream);
    assert_eq!(counted.name(), "statistics(driver)");
    round_trip(&counted, &s);
    let stats = counted.stats();
    assert_eq!((stats.total_allocations, stats.total_deallocations), (2, 2));
    assert_eq!((stats.current_bytes, stats.peak_bytes), (0, 2 * MIB));
    assert_eq!((stats.current_allocations, stats.peak_allocations), (0, 2));
    assert!(counted.allocate(0, &s).is_err());
    assert_eq!(counted.stats().failed_allocations, 1);
}

/// RMM's leak hunt: a tracking adaptor over the program's resource names what a loop forgot
/// to free (a raw allocation kept, a buffer leaked), with its size, stream and stack, and
/// holds nothing for what was freed; under a caching allocator it books the cache's segments.
#[test]
fn tracking_adaptor_names_what_is_outstanding_and_forgets_what_was_freed() {
    let gpu = require_gpu!();
    let (s, other) = (stream(&gpu.context), stream(&gpu.context));
    let tracked = Arc::new(TrackingAdaptor::with_backtraces(DriverResource::new(
        &gpu.context,
    )));
    assert_eq!(tracked.name(), "tracking(driver)");
    round_trip(&*tracked, &s);
    rejects_bad_input(&*tracked, &s);
    assert_eq!(tracked.outstanding_count(), 0);

    let resource = Arc::clone(&tracked) as Arc<dyn MemoryResource>;
    let mut kept = None;
    let mut leaked = None;
    for step in 0..100usize {
        let ptr = resource.allocate(4096 + step, &other).unwrap();
        let buffer = DeviceBuffer::<u8>::with_resource(Arc::clone(&resource), MIB, &s).unwrap();
        if step == 37 {
            kept = Some(ptr);
            leaked = Some(buffer.device_ptr());
            std::mem::forget(buffer);
        } else {
            resource.deallocate(ptr, 4096 + step, &other).unwrap();
        }
    }
    let outstanding = tracked.outstanding();
    let seen: Vec<_> = outstanding
        .iter()
        .map(|a| (a.ptr, a.bytes, a.owned, a.stream))
        .collect();
    assert_eq!(
        seen,
        [
            (kept.unwrap(), 4096 + 37, false, other.id()),
            (leaked.unwrap(), MIB, true, s.id())
        ],
        "oldest first: the raw allocation, then the leaked buffer"
    );
    assert_eq!(tracked.outstanding_bytes(), 4096 + 37 + MIB);
    assert!(outstanding[0].sequence < outstanding[1].sequence);
    // (Release builds here strip symbols, so the stack's frames are there but may be unnamed.)
    assert_eq!(
        outstanding[1].backtrace.as_ref().unwrap().status(),
        std::backtrace::BacktraceStatus::Captured,
        "the stack of the allocating call"
    );
    let report = tracked.report();
    assert!(
        report.starts_with(&format!(
            "tracking(driver): 2 allocations outstanding, {} bytes",
            4096 + 37 + MIB
        )),
        "{report}"
    );
    // The leaked buffer's memory is owned: the books refuse a free by address of it, as the
    // driver resource does, and keep it.
    assert!(matches!(
        resource.deallocate(leaked.unwrap(), MIB, &s),
        Err(MemoryError::OwnedAllocation { .. })
    ));
    resource
        .deallocate(kept.unwrap(), 4096 + 37, &other)
        .unwrap();
    assert_eq!(tracked.outstanding_count(), 1);

    // Under a caching allocator: the segments the cache holds, gone after empty_cache.
    let under = Arc::new(TrackingAdaptor::new(DriverResource::new(&gpu.context)));
    let cache = cuweave_memory::caching::CachingAllocator::new(
        Arc::clone(&under) as Arc<dyn MemoryResource>
    );
    for _ in 0..1000 {
        drop(DeviceBuffer::<u8>::with_allocator(&cache, 3 * MIB, &s).unwrap());
    }
    assert_eq!(
        under.outstanding_count(),
        1,
        "one segment for a thousand buffers"
    );
    assert!(under.outstanding()[0].owned && under.outstanding_bytes() >= 3 * MIB);
    s.synchronize().unwrap();
    cache.empty_cache().unwrap();
    assert_eq!(
        under.outstanding_count(),
        0,
        "empty_cache gave the segment back"
    );
}

#[path = "common/shared_log.rs"]
mod shared_log;
use shared_log::SharedLog;

/// RMM's logging adaptor: one CSV line per allocation, free and refusal, in order, with the
/// address, size and stream of each, readable for a replay; refusals are logged and still
/// refused, and a typed buffer's allocation and free appear too.
#[test]
fn logging_adaptor_writes_one_line_per_allocation_and_free_in_order() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let log = SharedLog::default();
    let logged =
        Arc::new(LoggingAdaptor::new(DriverResource::new(&gpu.context), log.clone()).unwrap());
    assert_eq!(logged.name(), "logging(driver)");
    round_trip(&*logged, &s);
    rejects_bad_input(&*logged, &s);
    let buffer = DeviceBuffer::<u32>::with_resource(
        Arc::clone(&logged) as Arc<dyn MemoryResource>,
        1000,
        &s,
    )
    .unwrap();
    let typed = buffer.device_ptr();
    drop(buffer);
    logged.flush().unwrap();
    assert_eq!(logged.write_errors(), 0);

    let text = log.text();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some(LOG_HEADER));
    let rows: Vec<Vec<&str>> = lines.map(|line| line.split(',').collect()).collect();
    assert!(rows.iter().all(|row| row.len() == 6), "{text}");
    let actions: Vec<(&str, &str)> = rows.iter().map(|row| (row[2], row[4])).collect();
    assert_eq!(
        actions,
        [
            ("allocate", "1048576"),
            ("allocate", "1048576"),
            ("free", "1048576"),
            ("free", "1048576"),
            ("allocate failure", "0"),
            ("allocate", "4096"),
            // A free is logged before the upstream runs it; a refusal follows its line.
            ("free", "512"),
            ("free failure", "512"),
            ("free", "4096"),
            ("free failure", "4096"),
            ("free", "4096"),
            ("free", "4096"),
            ("free failure", "4096"),
            ("allocate", "4000"),
            ("free", "4000"),
        ],
        "{text}"
    );
    // Every allocation's address comes back in its free; the stream is the one used.
    assert_eq!(rows[0][3], rows[2][3]);
    assert_eq!(rows[1][3], rows[3][3]);
    let typed = format!("{typed:#x}");
    assert_eq!((rows[13][3], rows[14][3]), (typed.as_str(), typed.as_str()));
    let id = s.id().to_string();
    assert!(rows.iter().all(|row| row[5] == id), "{text}");
    let times: Vec<u128> = rows.iter().map(|row| row[1].parse().unwrap()).collect();
    assert!(
        times.windows(2).all(|pair| pair[0] <= pair[1]),
        "in order: {text}"
    );
}

#[test]
fn limit_adaptor_refuses_past_its_cap_without_calling_upstream() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let cap = 3 * MIB;
    let limited = LimitAdaptor::new(
        StatisticsAdaptor::new(DriverResource::new(&gpu.context)),
        cap,
    );
    assert_eq!(limited.name(), "limit(statistics(driver))");
    round_trip(&limited, &s);
    let held = limited.allocate(2 * MIB, &s).unwrap();
    assert_eq!(limited.used(), 2 * MIB);
    assert_eq!(
        limited.allocate(2 * MIB, &s).unwrap_err(),
        MemoryError::OutOfMemory {
            requested: 2 * MIB,
            allocated: 2 * MIB,
            reserved: 2 * MIB,
            limit: Some(cap),
        }
    );
    let upstream = limited.upstream().stats();
    assert_eq!(
        upstream.total_allocations, 3,
        "the refused request never reached the driver"
    );
    assert_eq!(upstream.failed_allocations, 0);
    let fits = limited.allocate(MIB, &s).unwrap();
    assert_eq!(limited.used(), cap);
    limited.deallocate(held, 2 * MIB, &s).unwrap();
    limited.deallocate(fits, MIB, &s).unwrap();
    assert_eq!(limited.used(), 0);
}

/// A resource over the driver's that refuses its first free as a `CachingResource` does when a
/// capture has begun on another thread between a buffer's capture check and its free; later
/// frees go through.
struct RefusesFirstFree {
    upstream: DriverResource,
    refused: AtomicBool,
    freed: AtomicUsize,
}

// SAFETY: hands out exactly what the driver resource does, and frees through it (or refuses).
unsafe impl MemoryResource for RefusesFirstFree {
    fn allocate(&self, bytes: usize, stream: &Stream) -> cuweave_memory::Result<DevicePtr> {
        self.upstream.allocate(bytes, stream)
    }

    fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> cuweave_memory::Result<()> {
        if !self.refused.swap(true, Ordering::SeqCst) {
            return Err(MemoryError::NotCapturable {
                operation: "RefusesFirstFree::deallocate",
                reason: "a capture began on another thread: this test resource refuses its first free",
            });
        }
        self.upstream.deallocate(ptr, bytes, stream)?;
        self.freed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn context(&self) -> &Arc<Context> {
        self.upstream.context()
    }

    fn name(&self) -> &str {
        "refuses_first_free(driver)"
    }
}

/// A buffer's free that a capture begun meanwhile refuses is deferred, not leaked: with no
/// capture active, the flush right after it frees the memory (the resource's second call).
#[test]
fn a_free_refused_by_a_capture_begun_meanwhile_is_deferred_not_leaked() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let resource = Arc::new(RefusesFirstFree {
        upstream: DriverResource::new(context),
        refused: AtomicBool::new(false),
        freed: AtomicUsize::new(0),
    });
    let stream = stream(context);
    let mut buffer = DeviceBuffer::<u32>::with_resource(
        Arc::clone(&resource) as Arc<dyn MemoryResource>,
        MIB / 4,
        &stream,
    )
    .unwrap();
    buffer.fill(7).unwrap();
    drop(buffer);
    assert!(resource.refused.load(Ordering::SeqCst));
    assert_eq!(
        resource.freed.load(Ordering::SeqCst),
        1,
        "the refused free was retried once no capture was active"
    );
}

/// A typed buffer's address is visible to safe code (`Buffer::device_ptr`), so a free of it by
/// address through its resource, or of a cache's segment through the cache's upstream, would
/// hand memory still in use to the next allocation. Every resource refuses it with
/// `OwnedAllocation`, the buffer keeps its data, and its own drop still frees it.
#[test]
fn a_typed_buffers_memory_cannot_be_freed_by_address_through_its_resource() {
    let gpu = require_gpu!();
    let s = stream(&gpu.context);
    let data: Vec<u32> = (0..4096u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    let mut resources: Vec<Arc<dyn MemoryResource>> = vec![
        Arc::new(DriverResource::new(&gpu.context)),
        Arc::new(StatisticsAdaptor::new(Arc::new(LimitAdaptor::new(
            Arc::new(DriverResource::new(&gpu.context)) as Arc<dyn MemoryResource>,
            64 * MIB,
        ))
            as Arc<dyn MemoryResource>)),
        Arc::new(cuweave_memory::caching::CachingResource::new(
            cuweave_memory::caching::CachingAllocator::with_driver(&gpu.context),
        )),
    ];
    if gpu.device.supports_memory_pools().unwrap() {
        resources.push(Arc::new(AsyncPoolResource::new(&gpu.context).unwrap()));
    }
    for resource in resources {
        let name = resource.name().to_string();
        let mut buffer =
            DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), data.len(), &s).unwrap();
        buffer.copy_from_host(&data).unwrap();
        let refused = resource.deallocate(buffer.device_ptr(), buffer.byte_size(), &s);
        assert!(
            matches!(refused, Err(MemoryError::OwnedAllocation { .. })),
            "{name}: {refused:?}"
        );
        // A plain allocation next to it is freed by address as before.
        let plain = resource.allocate(buffer.byte_size(), &s).unwrap();
        assert_ne!(plain, buffer.device_ptr(), "{name}: not handed out again");
        let mut back = vec![0u32; data.len()];
        buffer.copy_to_host(&mut back).unwrap();
        assert_eq!(back, data, "{name}: the buffer kept its memory and data");
        resource.deallocate(plain, buffer.byte_size(), &s).unwrap();
        drop(buffer);
        // Its own drop freed it: the same pointer is unknown now.
        s.synchronize().unwrap();
    }

    // A caching allocator's segment, through the cache's upstream.
    let upstream = Arc::new(DriverResource::new(&gpu.context));
    let cache = cuweave_memory::caching::CachingAllocator::new(
        Arc::clone(&upstream) as Arc<dyn MemoryResource>
    );
    let block = cache.allocate(4 * MIB, &s).unwrap();
    let refused = upstream.deallocate(block.ptr(), block.block_size(), &s);
    assert!(
        matches!(
            refused,
            Err(MemoryError::OwnedAllocation { .. } | MemoryError::UnknownAllocation { .. })
        ),
        "{refused:?}"
    );
    assert_eq!(
        upstream.outstanding(),
        1,
        "the segment is still the cache's"
    );
    drop(block);
    cache.empty_cache().unwrap();
    assert_eq!(
        upstream.outstanding(),
        0,
        "the cache gave its segment back itself"
    );
}
