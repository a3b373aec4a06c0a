//! A poll that finds work pending costs no allocation: this test binary counts every heap
//! allocation made by the polling thread (a counting global allocator) while an event and a
//! stream are still busy behind a spinning kernel.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use cuweave_driver::{DriverError, Event, EventFlags, Stream, StreamFlags};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

/// The system allocator, counting the calling thread's allocations.
struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded unchanged to the system allocator; the count is a
// thread-local `Cell` with a const initialiser, which itself never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` above, i.e. from the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCATIONS.try_with(|count| count.set(count.get() + 1));
        // SAFETY: forwarded unchanged.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocations() -> u64 {
    ALLOCATIONS.with(Cell::get)
}

#[test]
fn a_not_ready_error_is_built_without_allocating() {
    let before = allocations();
    let error = std::hint::black_box(DriverError::Cuda {
        code: 600,
        operation: "cuEventQuery",
    });
    assert!(error.is_not_ready());
    assert_eq!(error.operation(), Some("cuEventQuery"));
    drop(error);
    assert_eq!(allocations() - before, 0);
}

#[test]
fn polling_busy_events_and_streams_allocates_nothing() {
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let event = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    // Warm up: the first poll on a thread may set up the driver's own per-thread state.
    assert_eq!(event.query(), Ok(true));
    assert_eq!(stream.query(), Ok(true));
    kernels.spin_ns(&stream, 500_000_000).unwrap();
    event.record(&stream).unwrap();
    let before = allocations();
    let mut pending = 0u32;
    for _ in 0..10_000 {
        pending += u32::from(!event.query().unwrap());
        pending += u32::from(!stream.query().unwrap());
    }
    let made = allocations() - before;
    stream.synchronize().unwrap();
    assert!(pending > 0, "the spin ended before the polls ran");
    assert_eq!(made, 0, "{made} allocations in {pending} not-ready polls");
    assert_eq!(event.query(), Ok(true));
}
