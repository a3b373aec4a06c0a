//! GPU tests of PyTorch's same-stream rule for typed buffers: a block dropped while its own
//! stream's work on it is still queued is handed out again on that stream at once, carrying
//! the event of that work, which every other stream, the legacy stream (blocking methods) and
//! the release to the driver wait for.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::Result;
use cuweave_memory::buffer::Buffer;
use cuweave_memory::caching::CachingAllocator;
use cuweave_memory::resource::{DriverResource, MemoryResource};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;
const MIB: usize = 1 << 20;

/// The tests watch whole-device timing (spins) and allocator statistics: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("stream")
}

#[test]
fn a_loop_that_never_syncs_reuses_one_block_behind_a_long_kernel() {
    // allocate 64 MiB on `s`, fill it, drop it, 1000 times, while a long spin keeps the GPU
    // behind the host: every block is dropped with its fill still queued. Each one goes back to
    // `s` at once (the next fill on `s` runs after the old one), so the allocator keeps one or
    // two blocks, not one per iteration in flight (64 GB, an out-of-memory retry on an H100).
    const LEN: usize = 16 * MIB; // 64 MiB of f32
    let _serial = serial();
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let s = stream(&gpu.context);
    let allocator = CachingAllocator::with_driver(&gpu.context);
    kernels.spin_ns(&s, 300 * MS).unwrap();
    let behind = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    behind.record(&s).unwrap();
    let mut last = None;
    for i in 0..1000u32 {
        let mut buffer = allocator.buffer::<f32>(LEN, &s).unwrap();
        buffer.fill_async(i as f32, &s).unwrap();
        last = Some(buffer); // drops the previous one
    }
    let stats = allocator.stats();
    if behind.query().unwrap() {
        // The host may block on a full launch queue; the bound below holds either way.
        eprintln!("note: the spin ended before the loop did");
    }
    // `last` holds the previous buffer while the next is allocated: two blocks alternate.
    assert!(
        stats.reserved_bytes.peak <= 2 * LEN * 4,
        "reserved {} bytes for 64 MiB blocks: {stats:?}",
        stats.reserved_bytes.peak
    );
    assert_eq!(stats.oom_retries, 0);
    assert!(stats.cache_misses <= 2);
    s.synchronize().unwrap();
    let last = last.unwrap();
    assert!(last.to_vec().unwrap().iter().all(|&x| x == 999.0));
}

#[test]
fn the_next_buffer_of_a_block_dropped_behind_queued_work_waits_for_it_on_other_streams() {
    // `a` is filled with 1.0 on `s` behind a spin and dropped at once; `b`, from `s`'s free
    // list, is the same block, handed out before that fill ran. `b` written on `t`, or by a
    // blocking copy (legacy stream), must land after the old fill: its tracker starts with the
    // old fill's event as a write on `s`.
    const LEN: usize = MIB;
    let _serial = serial();
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let (s, t) = (stream(&gpu.context), stream(&gpu.context));
    let allocator = CachingAllocator::with_driver(&gpu.context);
    for on_legacy in [false, true] {
        let mut a = allocator.buffer::<f32>(LEN, &s).unwrap();
        let address = a.device_ptr();
        kernels.spin_ns(&s, 200 * MS).unwrap();
        a.fill_async(1.0, &s).unwrap();
        drop(a);
        let mut b = allocator.buffer::<f32>(LEN, &s).unwrap();
        assert_eq!(
            b.device_ptr(),
            address,
            "handed out again on its stream at once"
        );
        if on_legacy {
            b.copy_from_host(&vec![2.0f32; LEN]).unwrap();
        } else {
            b.fill_async(2.0, &t).unwrap();
        }
        s.synchronize().unwrap();
        t.synchronize().unwrap();
        assert!(
            b.to_vec().unwrap().iter().all(|&x| x == 2.0),
            "b's write (on {}) was overwritten by a's queued fill",
            if on_legacy { "the legacy stream" } else { "t" }
        );
        // The same-stream case needs no wait at all, and is ordered by the stream.
        kernels.spin_ns(&s, 50 * MS).unwrap();
        b.fill_async(3.0, &s).unwrap();
        drop(b);
        let mut c = allocator.buffer::<f32>(LEN, &s).unwrap();
        assert_eq!(c.device_ptr(), address);
        c.fill_async(4.0, &s).unwrap();
        assert!(c.to_vec().unwrap().iter().all(|&x| x == 4.0));
    }
}

/// A driver resource that notes, at each `deallocate`, whether `watched` had completed.
struct Watching {
    inner: DriverResource,
    watched: Mutex<Option<Event>>,
    released_early: AtomicUsize,
    released: AtomicUsize,
}

impl MemoryResource for Watching {
    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        self.inner.allocate(bytes, stream)
    }

    fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if let Some(event) = &*self.watched.lock().unwrap()
            && !event.query()?
        {
            self.released_early.fetch_add(1, Ordering::SeqCst);
        }
        self.released.fetch_add(1, Ordering::SeqCst);
        self.inner.deallocate(ptr, bytes, stream)
    }

    fn context(&self) -> &Arc<Context> {
        self.inner.context()
    }

    fn name(&self) -> &str {
        "watching(driver)"
    }
}

#[test]
fn empty_cache_right_after_such_a_drop_waits_for_the_queued_work_before_freeing() {
    // The block goes back to its stream's free list with its fill still queued behind a spin;
    // `empty_cache` at once must not hand it to the driver before that fill has run.
    const LEN: usize = 16 * MIB;
    let _serial = serial();
    let gpu = require_gpu!();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let s = stream(&gpu.context);
    let upstream = Arc::new(Watching {
        inner: DriverResource::new(&gpu.context),
        watched: Mutex::new(None),
        released_early: AtomicUsize::new(0),
        released: AtomicUsize::new(0),
    });
    let allocator = CachingAllocator::new(Arc::clone(&upstream) as Arc<dyn MemoryResource>);
    let mut a = allocator.buffer::<f32>(LEN, &s).unwrap();
    kernels.spin_ns(&s, 300 * MS).unwrap();
    a.fill_async(1.0, &s).unwrap();
    let filled = Event::new(&gpu.context, EventFlags::DISABLE_TIMING).unwrap();
    filled.record(&s).unwrap();
    *upstream.watched.lock().unwrap() = Some(filled);
    drop(a);
    assert_eq!(
        allocator.pending_frees(),
        1,
        "the block carries the fill's event"
    );
    let released = allocator.empty_cache().unwrap();
    assert_eq!(released, LEN * 4);
    assert_eq!(upstream.released.load(Ordering::SeqCst), 1);
    assert_eq!(
        upstream.released_early.load(Ordering::SeqCst),
        0,
        "the segment went back to the driver before the fill queued on it had run"
    );
    let stats = allocator.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments_released),
        (0, 1)
    );
    assert_eq!(allocator.pending_frees(), 0);
}
