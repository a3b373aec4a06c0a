//! Giving memory back on a real GPU: a free never pulls memory out from under a kernel that still
//! reads it, address lookups find the allocation an address belongs to, and the calls that take
//! no context work from threads that have none current.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::memory::{
    self, DeviceAllocation, ManagedAllocation, MemoryPool, MemoryType, address_range,
};
use cuweave_driver::{Context, Device, Stream, StreamFlags, driver, sys};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const WORDS: usize = 1 << 16;
const WATCH: Duration = Duration::from_millis(100);

/// Everything a use-after-free probe needs: kernels, a stream that watches and one that writes,
/// and a zeroed mismatch counter.
struct Probe {
    kernels: TestKernels,
    watcher: Stream,
    writer: Stream,
    mismatches: DeviceAllocation,
}

impl Probe {
    fn new(context: &Arc<Context>) -> Self {
        let kernels = TestKernels::load(context).unwrap();
        let watcher = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
        let writer = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
        let mismatches = DeviceAllocation::new(context, 4).unwrap();
        // SAFETY: `mismatches` holds one u32; everything later that touches it is on `watcher`.
        unsafe { memory::memset_d32_async(mismatches.ptr(), 0, 1, &watcher) }.unwrap();
        Self {
            kernels,
            watcher,
            writer,
            mismatches,
        }
    }

    /// Fills `data` with 5 and starts a watch of it on the watcher stream; returns when it was
    /// launched (it cannot end before `WATCH` after that).
    ///
    /// # Safety
    /// `data` holds WORDS device-accessible u32s and stays mapped until the watch ends.
    unsafe fn watch(&self, data: u64) -> Instant {
        let launched = Instant::now();
        // SAFETY: the caller's contract; `mismatches` lives as long as `self`.
        unsafe {
            self.kernels
                .fill_u32(&self.watcher, data, 5, WORDS)
                .unwrap();
            self.kernels
                .watch_u32(
                    &self.watcher,
                    data,
                    WORDS,
                    5,
                    WATCH.as_nanos() as u64,
                    self.mismatches.ptr(),
                )
                .unwrap();
        }
        launched
    }

    /// Allocates the same size again and overwrites it at once on the writer stream, then waits
    /// for both streams and returns how many reads of the watch saw something other than 5.
    fn reuse_and_count(&self, context: &Arc<Context>) -> u32 {
        let reused = DeviceAllocation::new(context, WORDS * 4).unwrap();
        // SAFETY: `reused` holds WORDS u32s and outlives the synchronize.
        unsafe { self.kernels.fill_u32(&self.writer, reused.ptr(), 6, WORDS) }.unwrap();
        self.writer.synchronize().unwrap();
        self.watcher.synchronize().unwrap();
        let mut count = 0u32;
        // SAFETY: `count` is 4 writable bytes; the watcher that wrote the counter has finished.
        unsafe {
            memory::copy_dtoh(
                context,
                (&mut count as *mut u32).cast(),
                self.mismatches.ptr(),
                4,
            )
        }
        .unwrap();
        count
    }
}

fn assert_waited_for_the_watch(launched: Instant, what: &str) {
    let returned_after = launched.elapsed();
    // A tenth off for the host and GPU clocks not ticking quite alike.
    assert!(
        returned_after >= WATCH * 9 / 10,
        "{what} returned {returned_after:?} after launching a {WATCH:?} watch of the memory"
    );
}

#[test]
fn dropping_device_memory_waits_for_a_kernel_still_reading_it() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let probe = Probe::new(context);
    let data = DeviceAllocation::new(context, WORDS * 4).unwrap();
    // SAFETY: `data` holds WORDS u32s; whether it stays mapped until the watch ends is what the
    // drop below must guarantee.
    let launched = unsafe { probe.watch(data.ptr()) };
    drop(data);
    assert_waited_for_the_watch(launched, "dropping the allocation");
    assert_eq!(
        probe.reuse_and_count(context),
        0,
        "freed memory was reused under the watch"
    );
}

#[test]
fn an_explicit_free_waits_too_and_reports_success() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let probe = Probe::new(context);
    let data = DeviceAllocation::new(context, WORDS * 4).unwrap();
    // SAFETY: as above, with `free` in place of the drop.
    let launched = unsafe { probe.watch(data.ptr()) };
    data.free().unwrap();
    assert_waited_for_the_watch(launched, "DeviceAllocation::free");
    assert_eq!(
        probe.reuse_and_count(context),
        0,
        "freed memory was reused under the watch"
    );
}

#[test]
fn dropping_managed_memory_waits_for_a_kernel_still_reading_it() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let probe = Probe::new(context);
    let data = ManagedAllocation::new(context, WORDS * 4).unwrap();
    // SAFETY: as above; managed memory is device-accessible.
    let launched = unsafe { probe.watch(data.ptr()) };
    drop(data);
    assert_waited_for_the_watch(launched, "dropping the managed allocation");
    assert_eq!(
        probe.reuse_and_count(context),
        0,
        "freed memory was reused under the watch"
    );
}

#[test]
fn address_range_finds_the_allocation_around_an_address() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let device = DeviceAllocation::new(context, 3 << 20).unwrap();
    for offset in [0, 1, (3 << 20) - 1] {
        assert_eq!(
            address_range(context, device.ptr() + offset).unwrap(),
            (device.ptr(), device.len()),
            "offset {offset}"
        );
    }
    let managed = ManagedAllocation::new(context, 1 << 20).unwrap();
    assert_eq!(
        address_range(context, managed.ptr() + 4096).unwrap(),
        (managed.ptr(), managed.len())
    );
}

#[test]
fn calls_without_a_context_argument_work_on_threads_with_none_current() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    let device_memory = DeviceAllocation::new(context, 1 << 20).unwrap();
    let pool = MemoryPool::device_default(context).unwrap();
    let ptr = device_memory.ptr();
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let api = driver().unwrap();
                let mut current = std::ptr::null_mut();
                // SAFETY: `current` is a valid out-pointer.
                let status = unsafe { api.ctx_get_current.get().unwrap()(&mut current) };
                assert_eq!(status, sys::CUresult::CUDA_SUCCESS);
                assert!(current.is_null(), "a fresh thread already had a context");

                let attributes = memory::pointer_attributes(ptr).unwrap();
                assert_eq!(attributes.memory_type, MemoryType::Device);
                assert!(pool.release_threshold().is_ok());
                assert!(pool.reserved_bytes().is_ok());
                let device = Device::get(0).unwrap();
                assert!(!device.name().unwrap().is_empty());
                assert!(device.capabilities().is_ok());
            })
            .join()
            .expect("a context-free call failed");
    });
}
