//! Fourth-look probes of managed (unified) and page-locked host memory, written as the programs
//! users write, each aimed at a place the other files leave open:
//!
//! - read-mostly managed inputs prefetched by a plan and watched by kernels on three streams,
//!   with a view write on a fourth stream that must wait for every watcher;
//! - four threads sharing one pinned pool, each refilling a pair of pinned staging buffers from
//!   the host (the blocking, CPU-side copy) while device copies out of them are still queued;
//! - device writes into pinned and managed views of `u8`, `u16` and `u32` at odd offsets,
//!   read back by blocking host reads on other threads that must wait behind a closed gate;
//! - host access polled (`try_as_slice` / `try_as_mut_slice`) against spin-held work: refused
//!   until the work lands, and never showing or making a stale byte;
//! - prefetch plans over odd ranges of buffers of three element types, and bad entries;
//! - advice on odd sub-ranges read back per range;
//! - a pipeline through managed, device and pinned memory on three streams with host turns;
//! - the typed refusal of host slices on devices without concurrent managed access;
//! - pinned pool books through gated pending blocks, trims, cold and plain gets, and ten
//!   thousand mixed iterations.
//!
//! No test changes device settings. Managed allocations stay at 4 MiB each. Nothing sleeps to
//! make a result hold: queued work is held back by a `wait_u32` gate the host opens, or by a
//! spin kernel whose end the host only observes.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use cuweave_driver::memory::MemLocation;
use cuweave_driver::{Context, Device, DriverError, LaunchConfig};
use cuweave_memory::pinned_pool::{PinnedPoolConfig, block_size};
use cuweave_memory::{
    Buffer, DeviceBuffer, ManagedCapabilities, ManagedMemoryHints, MemoryError, MigrationPolicy,
    PinnedBuffer, PinnedPool, PinnedPoolStats, PrefetchPath, PrefetchPlan, TrackedLaunch,
    UnifiedBuffer,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{poll_until, require_gpu, serial, skip_under_sanitizer};

mod common;

#[path = "common/gate.rs"]
mod gate;
use gate::Gate;

#[path = "common/managed.rs"]
mod managed;
use managed::{assert_busy, managed_usable, stream, tracked_checksum};

#[path = "common/tracked.rs"]
mod tracked;
use tracked::try_tracked_fill;

/// `require_gpu!()` and `serial()` for `test`, returning from it (with a skip line) where device
/// 0 has no managed memory with concurrent access.
macro_rules! managed_gpu {
    ($test:expr) => {{
        let gpu = require_gpu!();
        let serial = serial();
        if !managed_usable(gpu.device, $test) {
            return;
        }
        (gpu, serial)
    }};
}

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const MS: u64 = 1_000_000;

fn assert_invalid_target<T: std::fmt::Debug>(result: cuweave_memory::Result<T>, what: &str) {
    assert!(
        matches!(
            result,
            Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
        ),
        "{what}: expected InvalidArgument, got {result:?}"
    );
}

fn assert_out_of_range<T: std::fmt::Debug>(result: cuweave_memory::Result<T>, what: &str) {
    assert!(
        matches!(result, Err(MemoryError::OutOfRange { .. })),
        "{what}: expected OutOfRange, got {result:?}"
    );
}

fn assert_zero_length<T: std::fmt::Debug>(result: cuweave_memory::Result<T>, what: &str) {
    assert!(
        matches!(result, Err(MemoryError::ZeroLength { .. })),
        "{what}: expected ZeroLength, got {result:?}"
    );
}

/// The books a pinned pool promises to keep at every moment.
fn assert_balanced(stats: &PinnedPoolStats, what: &str) {
    assert_eq!(
        stats.pinned_bytes,
        stats.allocated_bytes + stats.cached_bytes,
        "{what}: {stats:?}"
    );
    assert!(
        stats.pending_bytes <= stats.cached_bytes,
        "{what}: {stats:?}"
    );
    assert!(
        stats.pending_blocks <= stats.cached_blocks,
        "{what}: {stats:?}"
    );
    assert_eq!(stats.gets, stats.hits + stats.misses, "{what}: {stats:?}");
    assert!(stats.returns <= stats.gets, "{what}: {stats:?}");
    assert!(
        stats.peak_pinned_bytes >= stats.pinned_bytes,
        "{what}: {stats:?}"
    );
}

/// Counts a reader thread in `started` before `read` and in `finished` after it returns.
fn counted<T>(started: &AtomicUsize, finished: &AtomicUsize, read: impl FnOnce() -> T) -> T {
    started.fetch_add(1, Ordering::SeqCst);
    let got = read();
    finished.fetch_add(1, Ordering::SeqCst);
    got
}

/// The advice of `len` bytes at `offset` of `buffer`.
fn hints_of(buffer: &UnifiedBuffer<u8>, offset: usize, len: usize) -> ManagedMemoryHints<'_> {
    ManagedMemoryHints::for_range(buffer.range(offset, len).expect("range")).expect("hints")
}

/// The path a prefetch plan takes on this driver.
fn expected_path() -> PrefetchPath {
    if cuweave_driver::driver()
        .expect("driver")
        .mem_prefetch_batch_async
        .is_available()
    {
        PrefetchPath::Batched
    } else {
        PrefetchPath::PerRange
    }
}

// ---------------------------------------------------------------------------------------------
// Read-mostly data shared by kernels on several streams
// ---------------------------------------------------------------------------------------------

/// Read-mostly embeddings in managed memory, prefetched to the device by a plan, are read by
/// watch kernels on three streams at once (each rescans every element for 40 ms and counts any
/// that differ). A fill of the middle quarter through an exclusive view on a fourth stream must
/// wait for all three readers, not just the latest: any watcher that saw the new value counts
/// a mismatch. Afterwards the host sees the fill exactly in its quarter and the advice stands.
#[test]
fn read_mostly_managed_inputs_watched_on_three_streams_hold_back_a_view_fill_on_a_fourth() {
    let test =
        "read_mostly_managed_inputs_watched_on_three_streams_hold_back_a_view_fill_on_a_fourth";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(test, "needs kernels on four streams at once")
        || !managed_usable(gpu.device, test)
    {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let readers = [stream(context), stream(context), stream(context)];
    let writer = stream(context);
    let device = MemLocation::Device(gpu.device.ordinal());
    const N: usize = MIB; // u32s: 4 MiB
    const OLD: u32 = 0x00DD_BA11;
    const NEW: u32 = 0x7E57_AB1E;
    const WATCH_NS: u64 = 40 * MS;
    let mut inputs = UnifiedBuffer::from_slice(context, &vec![OLD; N]).expect("managed");
    inputs
        .apply_policy(&MigrationPolicy::ReadMostly)
        .expect("read mostly");
    {
        let mut plan = PrefetchPlan::new();
        plan.add(&inputs, device)
            .expect("whole buffer to the device");
        assert_eq!(plan.total_bytes(), 4 * N);
        assert_eq!(
            plan.execute(&readers[0]).expect("prefetch"),
            expected_path()
        );
    }
    let counters: Vec<_> = readers.iter().map(|_| common::counter(context)).collect();
    for (s, counter) in readers.iter().zip(&counters) {
        inputs.prepare_read(s).expect("prepare read");
        // SAFETY: the buffer holds N u32s of managed memory that outlive the watch (its read is
        // recorded right below; the fill, host access and the drop wait for it); the counter is
        // one u32 of device memory kept until the streams are synchronised.
        unsafe { kernels.watch_u32(s, inputs.device_ptr(), N, OLD, WATCH_NS, counter.ptr()) }
            .expect("watch kernel");
        inputs.record_read(s).expect("record read");
    }
    assert_eq!(inputs.concurrent_readers(), 3, "the three reads overlap");
    inputs
        .slice_mut(N / 4..N / 2)
        .expect("middle quarter")
        .fill_async(NEW, &writer)
        .expect("fill on the fourth stream");
    assert!(
        !writer.query().expect("query"),
        "the fill was not held behind the 40 ms watchers"
    );
    writer.synchronize().expect("fill");
    for s in &readers {
        s.synchronize().expect("watch");
    }
    for (i, counter) in counters.iter().enumerate() {
        assert_eq!(
            common::read_u32(context, counter.ptr()),
            0,
            "watcher {i} saw the fill: a write waited only for some of the readers"
        );
    }
    let host = inputs.as_slice().expect("host read");
    for (i, &got) in host.iter().enumerate() {
        let want = if (N / 4..N / 2).contains(&i) {
            NEW
        } else {
            OLD
        };
        assert_eq!(got, want, "element {i}");
    }
    drop(host);
    assert!(
        inputs
            .hints()
            .expect("hints")
            .read_mostly()
            .expect("read back"),
        "a device write through a view dropped the read-mostly advice"
    );
}

// ---------------------------------------------------------------------------------------------
// DataLoader staging from many threads through one pool
// ---------------------------------------------------------------------------------------------

/// The `pin_memory` DataLoader with a pair of pinned staging buffers per worker, written the
/// way PyTorch users write it: `staging.copy_(batch)` on the host (here the pinned buffer's
/// blocking `copy_from_host`, a CPU copy), then `slot.copy_(staging, non_blocking=True)` (a
/// device copy that reads the pinned memory where it lies, queued behind a 20 µs spin so the
/// host runs ahead). Refilling a staging buffer must wait for the copy still reading it, or the
/// device gets the next batch twice. Four threads share one pool and every 97 batches swap
/// their pair for new pool buffers (the old ones go back while their last copy may be queued).
/// Ten thousand batches: each thread's device checksum equals its host sum exactly, and the
/// pool's books balance with no more blocks pinned than were ever in flight.
#[test]
fn four_threads_refilling_pinned_staging_pairs_from_one_pool_never_change_a_queued_upload() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    const THREADS: usize = 4;
    const PER_THREAD: usize = 2_500;
    const BATCH: usize = 4 * KIB; // u32s: 16 KiB
    const SWAP_EVERY: usize = 97;
    let pool = PinnedPool::with_config(
        context,
        PinnedPoolConfig {
            max_cached_bytes: MIB,
            ..PinnedPoolConfig::default()
        },
    );
    let worker = |thread: usize| {
        let kernels = TestKernels::load(context).expect("kernels");
        let s = stream(context);
        let mut slot = DeviceBuffer::<u32>::new_on(&s, BATCH).expect("device slot");
        let total = DeviceBuffer::<u64>::zeroed(context, 1).expect("checksum");
        let fresh = || -> [PinnedBuffer<u32>; 2] {
            [
                pool.buffer(BATCH).expect("pool buffer"),
                pool.buffer(BATCH).expect("pool buffer"),
            ]
        };
        let mut staging = fresh();
        let mut batch = vec![0u32; BATCH];
        let mut expected = 0u64;
        for i in 0..PER_THREAD {
            if i % SWAP_EVERY == SWAP_EVERY - 1 {
                staging = fresh();
            }
            for (j, x) in batch.iter_mut().enumerate() {
                *x = ((thread * PER_THREAD + i) as u32).wrapping_mul(2_654_435_761) ^ j as u32;
                expected += u64::from(*x);
            }
            let stage = &mut staging[i % 2];
            stage
                .copy_from_host(&batch)
                .expect("host refill of the staging buffer");
            kernels.spin_ns(&s, 20_000).expect("spin");
            slot.copy_from_async(&*stage, &s)
                .expect("device copy from pinned");
            tracked_checksum(&kernels, &s, &slot, &total);
        }
        let got = total.to_vec().expect("checksum")[0];
        drop(staging);
        (got, expected)
    };
    let worker = &worker;
    let results: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| scope.spawn(move || worker(thread)))
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("worker"))
            .collect()
    });
    for (thread, (got, expected)) in results.into_iter().enumerate() {
        assert_eq!(
            got, expected,
            "thread {thread}: a staging buffer was refilled under a queued device copy"
        );
    }
    let stats = pool.stats();
    assert_balanced(&stats, "after the workers");
    let swaps = (0..PER_THREAD)
        .filter(|i| i % SWAP_EVERY == SWAP_EVERY - 1)
        .count();
    assert_eq!(stats.gets, (THREADS * 2 * (1 + swaps)) as u64, "{stats:?}");
    assert_eq!(stats.returns, stats.gets, "{stats:?}");
    assert_eq!(
        (stats.allocated_bytes, stats.allocated_blocks),
        (0, 0),
        "{stats:?}"
    );
    assert_eq!(stats.frees, 0, "nothing exceeded the 1 MiB cap: {stats:?}");
    let class = block_size(BATCH * 4).expect("class");
    // Each thread holds its pair and, at a swap, the pair whose last copies may be queued.
    assert!(
        stats.misses <= (THREADS * 4) as u64,
        "the pool pinned {} blocks for at most {} in flight: {stats:?}",
        stats.misses,
        THREADS * 4
    );
    assert!(stats.peak_pinned_bytes <= THREADS * 4 * class, "{stats:?}");
    assert_eq!(stats.pinned_bytes, stats.misses as usize * class);
}

// ---------------------------------------------------------------------------------------------
// Odd sizes and offsets, blocking host reads from other threads
// ---------------------------------------------------------------------------------------------

/// Device writes into views at odd offsets of buffers of odd lengths, held behind a closed
/// gate: a device-to-device copy into a `u8` pool pinned view (both sides at odd offsets), a
/// 16-bit fill of a `u16` managed view, and a tracked `fill_u32` kernel writing a `u32` pinned
/// view in place. Three threads then read the buffers with the blocking reads a user reaches
/// for first (`to_vec`, `as_slice`): none may return while the gate holds the writes back, and
/// each must return the written bytes exactly, with the bytes around each view untouched.
#[test]
fn blocking_host_reads_on_other_threads_wait_for_gated_writes_into_odd_views_and_see_them_exactly()
{
    let test = "blocking_host_reads_on_other_threads_wait_for_gated_writes_into_odd_views_and_see_them_exactly";
    let (gpu, _serial) = managed_gpu!(test);
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let fill = kernels.module().function("fill_u32").expect("fill_u32");
    let s = stream(context);
    let pool = PinnedPool::new(context);
    const BYTES: usize = 4099;
    const HALVES: usize = 100_001;
    const WORDS: usize = 1023;
    let source: Vec<u8> = (0..BYTES + 7).map(|i| (i * 31 + 7) as u8).collect();
    let device = DeviceBuffer::from_slice(context, &source).expect("device bytes");
    let mut bytes = pool.buffer::<u8>(BYTES).expect("pinned bytes");
    bytes.fill(0xEE).expect("host fill");
    let mut halves = UnifiedBuffer::<u16>::new(context, HALVES).expect("managed halves");
    let mut words = PinnedBuffer::<u32>::new(context, WORDS).expect("pinned words");
    words.fill(0x1111_1111).expect("host fill");

    let gate = Gate::new(context);
    gate.hold(&kernels, &s);
    bytes
        .slice_mut(1..BYTES - 1)
        .expect("odd pinned view")
        .copy_from_async(&device.slice(5..BYTES + 3).expect("odd source"), &s)
        .expect("copy into the pinned view");
    halves
        .slice_mut(3..HALVES - 2)
        .expect("odd managed view")
        .fill_async(0xBEEF, &s)
        .expect("16-bit fill");
    try_tracked_fill(
        &fill,
        &s,
        &mut words.slice_mut(5..WORDS - 2).expect("odd word view"),
        0xC0FF_EE00,
    )
    .expect("tracked launch");
    assert_busy(bytes.try_as_slice(), "pinned bytes under a gated copy");
    assert_busy(halves.try_as_slice(), "managed halves under a gated fill");
    assert_busy(words.try_as_slice(), "pinned words under a gated kernel");

    let started = AtomicUsize::new(0);
    let finished = AtomicUsize::new(0);
    let (got_bytes, got_halves, got_words) = std::thread::scope(|scope| {
        let (bytes, halves, words) = (&bytes, &halves, &words);
        let (started, finished) = (&started, &finished);
        let a = scope.spawn(move || {
            counted(started, finished, || {
                bytes.to_vec().expect("blocking read of pinned bytes")
            })
        });
        let b = scope.spawn(move || {
            counted(started, finished, || {
                halves.to_vec().expect("blocking read of managed halves")
            })
        });
        let c = scope.spawn(move || {
            counted(started, finished, || {
                words.as_slice().expect("host slice").to_vec()
            })
        });
        assert!(poll_until(Duration::from_secs(5), || started
            .load(Ordering::SeqCst)
            == 3));
        // A correct library cannot let any reader return before the gate opens; a bounded
        // look gives a broken one the chance to show it (the bytes below decide either way).
        let early = poll_until(Duration::from_millis(20), || {
            finished.load(Ordering::SeqCst) > 0
        });
        gate.open();
        let joined = (
            a.join().expect("reader a"),
            b.join().expect("reader b"),
            c.join().expect("reader c"),
        );
        assert!(
            !early,
            "a blocking host read returned while the write it must see was held"
        );
        joined
    });
    let mut want_bytes = vec![0xEEu8; BYTES];
    want_bytes[1..BYTES - 1].copy_from_slice(&source[5..BYTES + 3]);
    assert_eq!(got_bytes, want_bytes);
    let mut want_halves = vec![0u16; HALVES];
    want_halves[3..HALVES - 2].fill(0xBEEF);
    assert_eq!(got_halves, want_halves);
    let mut want_words = vec![0x1111_1111u32; WORDS];
    want_words[5..WORDS - 2].fill(0xC0FF_EE00);
    assert_eq!(got_words, want_words);
    assert!(bytes.is_idle().expect("idle") && halves.is_idle().expect("idle"));
}

// ---------------------------------------------------------------------------------------------
// Polling host access against spin-held work
// ---------------------------------------------------------------------------------------------

/// `Some` of a granted host access, `None` for `DeviceBusy`; panics on any other error.
fn granted<G>(result: cuweave_memory::Result<G>) -> Option<G> {
    match result {
        Ok(granted) => Some(granted),
        Err(MemoryError::DeviceBusy { .. }) => None,
        Err(other) => panic!("expected DeviceBusy or access, got {other:?}"),
    }
}

/// Calls `attempt` until it returns `Some` (at most 10 s); how often it returned `None` first.
fn poll_granted(mut attempt: impl FnMut() -> Option<()>) -> usize {
    let started = std::time::Instant::now();
    let mut refused = 0;
    while attempt().is_none() {
        refused += 1;
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "queued work never finished"
        );
        std::thread::yield_now();
    }
    refused
}

/// A program that polls instead of blocking (a server loop checking whether a result is ready).
/// Behind a 30 ms spin: a tracked kernel fills a view of a pool pinned buffer, a managed view is
/// filled, and a device buffer copies a pinned input. `try_as_slice` on the outputs is refused
/// until their writes land, and the first granted slice already holds every written element;
/// `try_as_mut_slice` on the input is refused until the device has read it, so the host's
/// overwrite, made the moment it is granted, never reaches the copy.
#[test]
fn polled_host_access_is_refused_until_spin_held_work_lands_and_never_sees_or_makes_stale_bytes() {
    let test = "polled_host_access_is_refused_until_spin_held_work_lands_and_never_sees_or_makes_stale_bytes";
    let (gpu, _serial) = managed_gpu!(test);
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let fill = kernels.module().function("fill_u32").expect("fill_u32");
    let s = stream(context);
    const N: usize = 256 * KIB + 3; // u32s
    const VALUE: u32 = 0xA5A5_0001;
    let pool = PinnedPool::new(context);
    let mut out = pool.buffer::<u32>(N).expect("pinned output");
    out.fill(0).expect("host zero");
    let mut managed = UnifiedBuffer::<u32>::new(context, N).expect("managed");
    let input_data: Vec<u32> = (0..N as u32).map(|i| i ^ 0x5EED).collect();
    let mut input = PinnedBuffer::from_slice(context, &input_data).expect("pinned input");
    let mut device = DeviceBuffer::<u32>::new_on(&s, N).expect("device");

    for round in 0..3u32 {
        kernels.spin_ns(&s, 30 * MS).expect("spin");
        try_tracked_fill(
            &fill,
            &s,
            &mut out.slice_mut(1..N - 1).expect("view"),
            VALUE + round,
        )
        .expect("tracked fill");
        managed
            .slice_mut(2..)
            .expect("managed view")
            .fill_async(VALUE + round, &s)
            .expect("managed fill");
        device
            .copy_from_async(&input, &s)
            .expect("device copy reading the pinned input");
        assert!(!s.query().expect("query"), "the 30 ms spin ended too early");

        let refused = poll_granted(|| {
            granted(out.try_as_slice()).map(|host| {
                assert_eq!(host[0], 0, "round {round}: outside the view");
                assert_eq!(host[N - 1], 0, "round {round}: outside the view");
                assert!(
                    host[1..N - 1].iter().all(|&v| v == VALUE + round),
                    "round {round}: the first granted slice held stale bytes"
                );
            })
        });
        assert!(
            refused > 0,
            "round {round}: the pinned output was never busy"
        );
        poll_granted(|| {
            granted(managed.try_as_slice()).map(|host| {
                assert_eq!(&host[..2], &[0, 0], "round {round}: outside the view");
                assert!(
                    host[2..].iter().all(|&v| v == VALUE + round),
                    "round {round}: managed memory showed stale bytes"
                );
            })
        });
        poll_granted(|| {
            granted(input.try_as_mut_slice()).map(|mut host| {
                assert_eq!(&host[..], &input_data[..], "round {round}");
                // The copy has read the input: overwriting it now must not reach the device.
                host.fill(0xDEAD_BEEF);
            })
        });
        assert_eq!(
            device.to_vec().expect("device copy"),
            input_data,
            "round {round}: the host's overwrite reached a copy that was still queued"
        );
        input
            .copy_from_host(&input_data)
            .expect("restore the input");
    }
}

// ---------------------------------------------------------------------------------------------
// Prefetch plans over odd ranges, and bad input
// ---------------------------------------------------------------------------------------------

/// A prefetch plan over odd ranges of three managed buffers of different element types (`u8`
/// of odd length at odd byte offsets, `u16` by a hints sub-range, `u64` whole): its entries,
/// byte total and path are as built; refused entries (devices that do not exist) leave it as it
/// was. Device fills through views of the prefetched ranges (byte, 16-bit and 8-byte pattern
/// fills) and a second plan back to the host, and the host reads exact bytes. Bad ranges, an
/// empty plan and a cleared plan are typed errors.
#[test]
fn prefetch_plans_over_odd_ranges_of_three_element_types_round_trip_and_refuse_bad_entries() {
    let test =
        "prefetch_plans_over_odd_ranges_of_three_element_types_round_trip_and_refuse_bad_entries";
    let (gpu, _serial) = managed_gpu!(test);
    let context = &gpu.context;
    let s = stream(context);
    let device = MemLocation::Device(gpu.device.ordinal());
    let count = Device::count().expect("count");
    const BYTES: usize = 1_000_003;
    const HALVES: usize = 300_007;
    const WIDE: usize = 131_071;
    const PATTERN: u64 = 0x0123_4567_89AB_CDEF;
    let mut bytes = UnifiedBuffer::<u8>::new(context, BYTES).expect("u8");
    let mut halves = UnifiedBuffer::<u16>::new(context, HALVES).expect("u16");
    let mut wide = UnifiedBuffer::<u64>::new(context, WIDE).expect("u64");
    {
        let mut plan = PrefetchPlan::new();
        plan.add(bytes.range(3, 4093).expect("head"), device)
            .expect("head")
            .add(bytes.range(500_001, 499_999).expect("tail"), device)
            .expect("tail")
            .add(
                halves
                    .hints()
                    .expect("hints")
                    .subrange(1, HALVES - 2)
                    .expect("inner"),
                device,
            )
            .expect("inner")
            .add(&wide, device)
            .expect("whole");
        assert_invalid_target(
            plan.add(&wide, MemLocation::Device(count)).map(drop),
            "a target one past the last device",
        );
        assert_invalid_target(
            plan.add(&wide, MemLocation::Device(usize::MAX)).map(drop),
            "a target at usize::MAX",
        );
        assert_eq!(plan.len(), 4, "a refused entry changed the plan");
        assert_eq!(
            plan.total_bytes(),
            4093 + 499_999 + 2 * (HALVES - 2) + 8 * WIDE
        );
        let entries: Vec<_> = plan.entries().collect();
        assert_eq!(
            entries,
            vec![
                (bytes.device_ptr() + 3, 4093, device),
                (bytes.device_ptr() + 500_001, 499_999, device),
                (halves.device_ptr() + 2, 2 * (HALVES - 2), device),
                (wide.device_ptr(), 8 * WIDE, device),
            ]
        );
        assert_eq!(plan.execute(&s).expect("execute"), expected_path());
        // Executed plans can run again, then be cleared; an empty plan has nothing to issue.
        assert_eq!(plan.execute(&s).expect("again"), expected_path());
        plan.clear();
        assert_zero_length(plan.execute(&s), "a cleared plan");
    }
    assert_zero_length(PrefetchPlan::new().execute(&s), "an empty plan");

    bytes
        .slice_mut(3..4096)
        .expect("head view")
        .fill_async(0x5A, &s)
        .expect("byte fill");
    bytes
        .slice_mut(500_001..)
        .expect("tail view")
        .fill_async(0xC3, &s)
        .expect("byte fill");
    halves
        .slice_mut(1..HALVES - 1)
        .expect("inner view")
        .fill_async(0xBEEF, &s)
        .expect("16-bit fill");
    wide.slice_mut(1..WIDE - 1)
        .expect("wide view")
        .fill_async(PATTERN, &s)
        .expect("pattern fill");
    {
        let mut back = PrefetchPlan::new();
        back.add(&bytes, MemLocation::Host)
            .expect("bytes")
            .add(&halves, MemLocation::Host)
            .expect("halves")
            .add(&wide, MemLocation::Host)
            .expect("wide");
        assert_eq!(back.execute(&s).expect("back"), expected_path());
    }
    let host = bytes.as_slice().expect("bytes");
    for (i, &got) in host.iter().enumerate() {
        let want = match i {
            3..4096 => 0x5A,
            500_001.. => 0xC3,
            _ => 0,
        };
        assert_eq!(got, want, "byte {i}");
    }
    drop(host);
    let host = halves.as_slice().expect("halves");
    assert_eq!((host[0], host[HALVES - 1]), (0, 0));
    assert!(host[1..HALVES - 1].iter().all(|&v| v == 0xBEEF));
    drop(host);
    let host = wide.as_slice().expect("wide");
    assert_eq!((host[0], host[WIDE - 1]), (0, 0));
    assert!(host[1..WIDE - 1].iter().all(|&v| v == PATTERN));
    drop(host);
    assert_eq!(
        wide.hints()
            .expect("hints")
            .last_prefetch_location()
            .expect("read back"),
        Some(MemLocation::Host)
    );

    // Bad ranges and targets through every door.
    assert_out_of_range(bytes.range(BYTES, 1).map(drop), "range at the end");
    assert_zero_length(bytes.range(0, 0).map(drop), "empty range");
    assert_out_of_range(
        halves.prefetch_range(1, usize::MAX, MemLocation::Host, &s),
        "prefetch of usize::MAX elements",
    );
    assert_out_of_range(
        wide.hints()
            .expect("hints")
            .prefetch_range(usize::MAX, 2, device, &s),
        "prefetch at usize::MAX",
    );
    assert_out_of_range(
        wide.hints().expect("hints").subrange(WIDE - 1, 2).map(drop),
        "subrange past the end",
    );
    assert_invalid_target(
        wide.prefetch_to(MemLocation::Device(count), &s),
        "prefetch to a missing device",
    );
    assert_invalid_target(
        bytes.prefetch_range(0, 1, MemLocation::Device(usize::MAX), &s),
        "ranged prefetch to usize::MAX",
    );
    assert_out_of_range(
        bytes.slice(10..std::hint::black_box(5)).map(drop),
        "a reversed view",
    );
    assert_out_of_range(bytes.slice(..=BYTES).map(drop), "a view one past the end");
}

// ---------------------------------------------------------------------------------------------
// Advice on odd sub-ranges
// ---------------------------------------------------------------------------------------------

/// Advice on three odd sub-ranges of one managed byte buffer (5 bytes inside a page, 64 KiB + 1
/// bytes starting 3 bytes into a megabyte, the last 7 bytes): each reads back on its own range,
/// none on the whole buffer nor on a megabyte far from all three; sub-ranges taken by element
/// from a `u64` buffer's hints are at the right byte addresses; unsetting clears each range;
/// and the data written before, through device fills and host writes, is never changed.
#[test]
fn advice_on_odd_sub_ranges_reads_back_per_range_and_never_touches_the_data() {
    let test = "advice_on_odd_sub_ranges_reads_back_per_range_and_never_touches_the_data";
    let (gpu, _serial) = managed_gpu!(test);
    let context = &gpu.context;
    let s = stream(context);
    let device = MemLocation::Device(gpu.device.ordinal());
    const N: usize = 4 * MIB; // bytes
    let data: Vec<u8> = (0..N).map(|i| (i % 251) as u8).collect();
    let mut buffer = UnifiedBuffer::from_slice(context, &data).expect("managed bytes");
    let (inside, across, last) = (
        hints_of(&buffer, 4099, 5),
        hints_of(&buffer, MIB + 3, 64 * KIB + 1),
        hints_of(&buffer, N - 7, 7),
    );
    let far = hints_of(&buffer, 2 * MIB, MIB);
    inside.set_read_mostly().expect("read mostly");
    across
        .set_preferred_location(device)
        .expect("preferred device");
    last.set_accessed_by(MemLocation::Host)
        .expect("accessed by host");
    assert!(inside.read_mostly().expect("inside"));
    assert_eq!(across.preferred_location().expect("across"), Some(device));
    assert!(
        last.accessed_by()
            .expect("last")
            .contains(&MemLocation::Host)
    );
    let whole = buffer.hints().expect("whole");
    assert!(!whole.read_mostly().expect("whole"));
    assert_eq!(whole.preferred_location().expect("whole"), None);
    assert!(!far.read_mostly().expect("far"));
    assert_eq!(far.preferred_location().expect("far"), None);
    assert!(far.accessed_by().expect("far").is_empty());
    // Byte sub-ranges of a raw range: offsets in bytes.
    let sub = across.subrange(1, 10).expect("sub of across");
    assert_eq!(
        (sub.ptr(), sub.bytes()),
        (buffer.device_ptr() + (MIB + 4) as u64, 10)
    );
    assert_out_of_range(across.subrange(64 * KIB, 2).map(drop), "past across");
    drop((inside, across, last, far, whole, sub));

    // Element sub-ranges of a typed buffer's hints.
    let wide = UnifiedBuffer::<u64>::new(context, 1001).expect("u64");
    let wide_hints = wide.hints().expect("hints");
    let piece = wide_hints.subrange(3, 7).expect("piece");
    assert_eq!(
        (piece.ptr(), piece.bytes()),
        (wide.device_ptr() + 24, 56),
        "element offsets of a u64 buffer"
    );
    ManagedMemoryHints::for_range(piece)
        .expect("piece hints")
        .set_read_mostly()
        .expect("read mostly piece");
    assert!(
        ManagedMemoryHints::for_range(wide_hints.subrange(3, 7).expect("again"))
            .expect("hints")
            .read_mostly()
            .expect("piece")
    );

    // The data is untouched by the advice; device and host writes work under it.
    assert_eq!(buffer.to_vec().expect("copy out"), data);
    buffer
        .slice_mut(4099..4104)
        .expect("read-mostly bytes")
        .fill_async(0xAB, &s)
        .expect("device fill under read-mostly");
    buffer.as_mut_slice().expect("host")[N - 7..].fill(0xCD);
    let mut want = data.clone();
    want[4099..4104].fill(0xAB);
    want[N - 7..].fill(0xCD);
    assert_eq!(buffer.as_slice().expect("host"), &want[..]);

    hints_of(&buffer, 4099, 5)
        .unset_read_mostly()
        .expect("unset");
    hints_of(&buffer, MIB + 3, 64 * KIB + 1)
        .unset_preferred_location()
        .expect("unset");
    hints_of(&buffer, N - 7, 7)
        .unset_accessed_by(MemLocation::Host)
        .expect("unset");
    assert!(!hints_of(&buffer, 4099, 5).read_mostly().expect("inside"));
    assert_eq!(
        hints_of(&buffer, MIB + 3, 64 * KIB + 1)
            .preferred_location()
            .expect("across"),
        None
    );
    assert!(
        hints_of(&buffer, N - 7, 7)
            .accessed_by()
            .expect("last")
            .is_empty()
    );
    assert_eq!(buffer.as_slice().expect("host"), &want[..]);
}

// ---------------------------------------------------------------------------------------------
// Managed, device and pinned memory across three streams
// ---------------------------------------------------------------------------------------------

/// A training-step shape through three kinds of memory: a managed buffer is copied into a
/// device buffer on stream A, a kernel increments the device buffer on stream B (behind a spin,
/// so the host runs ahead), the lower half is copied back into the managed buffer on A, the
/// whole managed buffer is mirrored into a pinned buffer on C, and the host then reads the
/// mirror and adds to the managed buffer's upper half. Every arrow crosses streams through the
/// buffers' own tracking only. Three hundred steps against a host model, every element exact.
#[test]
fn a_pipeline_through_managed_device_and_pinned_memory_on_three_streams_matches_a_host_model() {
    let test =
        "a_pipeline_through_managed_device_and_pinned_memory_on_three_streams_matches_a_host_model";
    let (gpu, _serial) = managed_gpu!(test);
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let increment = kernels
        .module()
        .function("increment_u32")
        .expect("increment_u32");
    let (a, b, c) = (stream(context), stream(context), stream(context));
    const N: usize = 64 * KIB + 5; // u32s
    const H: usize = N / 2;
    const STEPS: usize = 300;
    let mut model: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(7)).collect();
    let mut managed = UnifiedBuffer::from_slice(context, &model).expect("managed");
    let mut device = DeviceBuffer::<u32>::new_on(&a, N).expect("device");
    let mut mirror = PinnedBuffer::<u32>::new(context, N).expect("pinned mirror");
    let config = LaunchConfig::for_elements(N, 256).expect("config");
    let n = N as u64;
    for step in 0..STEPS {
        device
            .copy_from_async(&managed, &a)
            .expect("managed to device");
        kernels.spin_ns(&b, 20_000).expect("spin");
        // SAFETY: increment_u32(unsigned*, size_t) gets the device buffer (declared written)
        // and its length.
        unsafe {
            TrackedLaunch::new(&increment, &b, config)
                .write(&mut device)
                .arg(&n)
                .launch()
        }
        .expect("increment");
        managed
            .slice_mut(..H)
            .expect("lower half")
            .copy_from_async(&device.slice(..H).expect("lower half"), &a)
            .expect("device to managed");
        mirror
            .copy_from_async(&managed, &c)
            .expect("managed to pinned");
        for x in &mut model[..H] {
            *x = x.wrapping_add(1);
        }
        assert_eq!(
            mirror.as_slice().expect("mirror"),
            &model[..],
            "step {step}: the mirror missed a write"
        );
        let add = step as u32 + 1;
        for x in &mut managed.as_mut_slice().expect("host turn")[H..] {
            *x = x.wrapping_add(add);
        }
        for x in &mut model[H..] {
            *x = x.wrapping_add(add);
        }
    }
    assert_eq!(managed.to_vec().expect("final"), model);
    let device_final = device.to_vec().expect("device");
    for (i, (&got, &m)) in device_final.iter().zip(&model).enumerate().take(H) {
        assert_eq!(got, m, "device element {i}");
    }
    assert!(managed.tracked_uses() <= 32 && mirror.tracked_uses() <= 32);
}

// ---------------------------------------------------------------------------------------------
// Host slices of managed memory and concurrent managed access
// ---------------------------------------------------------------------------------------------

/// On every device: host slices of a managed buffer are granted exactly where the device has
/// concurrent managed access, and elsewhere refused with `CapabilityMissing` naming the device
/// (as are prefetches), while the `Buffer` copies keep working and round-trip the bytes.
#[test]
fn host_slices_of_managed_memory_are_granted_exactly_on_devices_with_concurrent_access() {
    let gpu = require_gpu!();
    let _serial = serial();
    let count = Device::count().expect("count");
    for ordinal in 0..count {
        let device = Device::get(ordinal).expect("device");
        let capabilities = ManagedCapabilities::of(device).expect("capabilities");
        assert_eq!(capabilities.device, ordinal);
        let context = if ordinal == gpu.device.ordinal() {
            Arc::clone(&gpu.context)
        } else {
            Context::primary(device).expect("context")
        };
        if !capabilities.managed_memory {
            assert!(matches!(
                UnifiedBuffer::<u32>::new(&context, 16),
                Err(MemoryError::Driver(DriverError::CapabilityMissing { .. }))
            ));
            continue;
        }
        let s = stream(&context);
        let data: Vec<u32> = (0..4097u32).map(|i| i.rotate_left(7)).collect();
        let mut buffer = UnifiedBuffer::from_slice(&context, &data).expect("managed");
        assert_eq!(buffer.to_vec().expect("copy out"), data);
        if capabilities.concurrent_managed_access {
            assert_eq!(buffer.as_slice().expect("slice"), &data[..]);
            assert_eq!(buffer.try_as_slice().expect("slice"), &data[..]);
            buffer.as_mut_slice().expect("mut slice")[4096] = 1;
            buffer
                .prefetch_to(MemLocation::Device(ordinal), &s)
                .expect("prefetch");
            assert_eq!(buffer.as_slice().expect("slice")[4096], 1);
        } else {
            let refused = |result: cuweave_memory::Result<()>, what: &str| match result {
                Err(MemoryError::Driver(DriverError::CapabilityMissing { device, .. })) => {
                    assert_eq!(device, ordinal, "{what}");
                }
                other => panic!("{what} on device {ordinal}: {other:?}"),
            };
            refused(buffer.as_slice().map(drop), "as_slice");
            refused(buffer.try_as_slice().map(drop), "try_as_slice");
            refused(buffer.as_mut_slice().map(drop), "as_mut_slice");
            refused(buffer.try_as_mut_slice().map(drop), "try_as_mut_slice");
            refused(
                buffer.prefetch_to(MemLocation::Device(ordinal), &s),
                "prefetch",
            );
            let mut plan = PrefetchPlan::new();
            refused(plan.add(&buffer, MemLocation::Host).map(drop), "plan entry");
            buffer.copy_range_from_host(4096, &[1]).expect("copy in");
        }
        let mut want = data.clone();
        want[4096] = 1;
        assert_eq!(buffer.to_vec().expect("copy out"), want);
    }
}

// ---------------------------------------------------------------------------------------------
// Pinned pool books under mixed use
// ---------------------------------------------------------------------------------------------

/// A pool's books through every kind of use. Three pool buffers read by device copies queued
/// behind a closed gate go back pending: `trim` frees none of them, a `get` of their class pins
/// a fourth, and the pending figures stay as of the last poll until the next one after the gate
/// opens. Then ten thousand iterations mix plain and cold gets, typed blocks recorded on two
/// streams and pool buffers read by copies, at four sizes: the books balance at every step,
/// the ready cache stays under its cap, and pinned memory stays bounded; a final trim unpins
/// everything.
#[test]
fn pinned_pool_books_balance_through_gated_pending_blocks_trims_and_ten_thousand_mixed_gets() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let (s, t) = (stream(context), stream(context));
    const CAP: usize = 2 * MIB;
    const N: usize = 16 * KIB; // u32s: 64 KiB
    let class = block_size(N * 4).expect("class");
    let pool = PinnedPool::with_config(
        context,
        PinnedPoolConfig {
            max_cached_bytes: CAP,
            ..PinnedPoolConfig::default()
        },
    );
    let mut device = DeviceBuffer::<u32>::new_on(&s, N).expect("device");

    let gate = Gate::new(context);
    gate.hold(&kernels, &s);
    let mut held = Vec::new();
    for k in 0..3u32 {
        let mut staged = pool.buffer::<u32>(N).expect("pool buffer");
        staged.fill(k + 1).expect("host fill");
        device.copy_from_async(&staged, &s).expect("gated read");
        held.push(staged.as_host_ptr() as usize);
        drop(staged);
    }
    let stats = pool.stats();
    assert_balanced(&stats, "after the gated drops");
    assert_eq!(
        (stats.gets, stats.returns, stats.misses),
        (3, 3, 3),
        "{stats:?}"
    );
    assert_eq!(stats.cached_blocks, 3, "{stats:?}");
    assert_eq!(
        pool.trim(),
        0,
        "trim freed a block a queued copy still reads"
    );
    let stats = pool.stats();
    assert_eq!(
        (stats.pending_blocks, stats.pending_bytes),
        (3, 3 * class),
        "{stats:?}"
    );
    let fourth = pool.get_typed::<u32>(N).expect("fourth");
    assert!(
        !held.contains(&(fourth.as_slice().as_ptr() as usize)),
        "a pending block was handed out"
    );
    assert_eq!(pool.stats().misses, 4);
    gate.open();
    s.synchronize().expect("copies");
    assert_eq!(
        device.to_vec().expect("device"),
        vec![3u32; N],
        "the last gated copy read another owner's bytes"
    );
    drop(fourth);
    let freed = pool.trim();
    assert_eq!(freed, 4 * class, "trim after the copies landed");
    let stats = pool.stats();
    assert_balanced(&stats, "after the trim");
    assert_eq!(
        (stats.pinned_bytes, stats.cached_blocks, stats.frees),
        (0, 0, 4),
        "{stats:?}"
    );

    const ITERATIONS: usize = 10_000;
    const LENS: [usize; 4] = [1, 1000, 5000, N];
    let mut live: Vec<PinnedBuffer<u32>> = Vec::new();
    let mut blocks = Vec::new();
    let mut expected_gets = stats.gets;
    for i in 0..ITERATIONS {
        let len = LENS[(i * 7 + i / 3) % LENS.len()];
        match i % 4 {
            0 => {
                let mut staged = pool.buffer::<u32>(len).expect("buffer");
                staged.fill(i as u32).expect("host fill");
                device
                    .copy_range_from_async(0, &staged, 0, len, &s)
                    .expect("read by a copy");
                live.push(staged);
            }
            1 => {
                let mut block = pool.get_typed_cold::<u32>(len).expect("cold");
                block.as_mut_slice().fill(i as u32);
                block.record(&t).expect("record");
                blocks.push(block);
            }
            2 => {
                let mut block = pool.get_typed::<u32>(len).expect("plain");
                block.record(&s).expect("record");
                block.record(&t).expect("record");
                blocks.push(block);
            }
            _ => {
                let block = pool.get(len * 4).expect("raw");
                drop(block);
            }
        }
        expected_gets += 1;
        if live.len() > 3 {
            drop(live.remove(0));
        }
        if blocks.len() > 3 {
            drop(blocks.remove(0));
        }
        let stats = pool.stats();
        assert_balanced(&stats, "mixed use");
        assert!(stats.ready_bytes() <= CAP, "step {i}: {stats:?}");
        assert!(
            stats.allocated_blocks <= 7,
            "step {i}: blocks leaked out of the books: {stats:?}"
        );
        if i % 1000 == 999 {
            s.synchronize().expect("s");
            t.synchronize().expect("t");
        }
    }
    drop(live);
    drop(blocks);
    s.synchronize().expect("s");
    t.synchronize().expect("t");
    let stats = pool.stats();
    assert_balanced(&stats, "after the loop");
    assert_eq!(stats.gets, expected_gets, "{stats:?}");
    assert_eq!(stats.returns, stats.gets, "{stats:?}");
    assert_eq!(stats.allocated_bytes, 0, "{stats:?}");
    assert!(
        stats.peak_pinned_bytes <= CAP + PinnedPool::COLD_ROTATION_BYTES + 8 * class,
        "pinned memory grew with the iterations: {stats:?}"
    );
    pool.trim();
    let stats = pool.stats();
    assert_eq!(
        (stats.pinned_bytes, stats.cached_bytes, stats.pending_bytes),
        (0, 0, 0),
        "{stats:?}"
    );
}
