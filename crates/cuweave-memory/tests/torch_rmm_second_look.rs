//! A second look at what PyTorch's caching allocator, RMM's memory resources and cudarc users
//! expect of this crate, aimed at what the earlier program files leave out:
//!
//! - the rule "work queued by hand on `device_ptr()` must be recorded, or be on the stream the
//!   buffer was allocated for" taken at its word, for a stream-ordered resource buffer (RMM's
//!   `device_buffer` frees on its own stream) and for a cached buffer whose block the next
//!   buffer uses on another stream;
//! - a borrowed handle of one raw stream per request (`torch.cuda.ExternalStream`, cudarc
//!   interop), which PyTorch's cache keys by the raw stream;
//! - `torch.cuda.memory_stats()`-style books that reconcile to the byte for every small size
//!   and along the large-pool size table, with peaks reset and `empty_cache` returning all;
//! - `active_bytes` and pending frees around `record_stream`, a dropped stream's segment that
//!   waits for a slow reader, views read on two streams, eight threads churning ten thousand
//!   buffers each with device-side checksums, and a default allocator replaced mid-program.
//!
//! Each test checks bytes, kernel-observed values or statistics that must reconcile exactly,
//! uses well under a GiB, and runs in a few seconds on an H200. They use private allocators
//! (except the one that replaces the default, under `serial()`), so they do not disturb each
//! other's books.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Barrier};

use cuweave_driver::memory::{copy_dtoh, memset_d8_async, memset_d32_async};
use cuweave_driver::{Context, Event, EventFlags, Stream, StreamFlags};
use cuweave_memory::{
    Buffer, CachedAllocation, CachingAllocator, DeviceBuffer, DriverResource, LimitAdaptor,
    MemoryError, MemoryResource, StatisticsAdaptor,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial, skip, skip_under_sanitizer};

#[path = "common/async_pool.rs"]
mod async_pool;
use async_pool::async_pool_or_skip;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const MS: u64 = 1_000_000;

fn stream(context: &Arc<Context>) -> Stream {
    Stream::new(context, StreamFlags::NON_BLOCKING).expect("create stream")
}

/// A 64-bit LCG: the same "random" program on every run.
fn next(state: &mut u64) -> usize {
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    (*state >> 33) as usize
}

/// `bytes` rounded up to the allocator's 512-byte granularity.
fn rounded(bytes: usize) -> usize {
    bytes.div_ceil(512) * 512
}

/// Whether `[a, a + a_len)` and `[b, b + b_len)` share a byte.
fn overlaps(a: u64, a_len: usize, b: u64, b_len: usize) -> bool {
    a < b + b_len as u64 && b < a + a_len as u64
}

/// One byte of device memory, read back with a blocking copy.
fn byte_at(context: &Context, ptr: u64) -> u8 {
    let mut byte = [0u8];
    // SAFETY: the callers pass an address inside a live allocation whose writes have finished
    // (their stream was synchronised); one byte is written to a one-byte array.
    unsafe { copy_dtoh(context, byte.as_mut_ptr(), ptr, 1) }.expect("read one byte");
    byte[0]
}

/// One `u32` of device memory, read back with a blocking copy.
fn word_at(context: &Context, ptr: u64) -> u32 {
    let mut word = [0u8; 4];
    // SAFETY: as in `byte_at`, for four bytes.
    unsafe { copy_dtoh(context, word.as_mut_ptr(), ptr, 4) }.expect("read one word");
    u32::from_le_bytes(word)
}

// ---------------------------------------------------------------------------------------------
// Work on the allocating stream, unrecorded, as the rules allow
// ---------------------------------------------------------------------------------------------

/// RMM: `rmm::device_buffer buf(n, stream, async_mr); kernel<<<.., stream>>>(buf.data()); }`.
/// The buffer's own kernel, queued on the stream the buffer was allocated on, writes it late
/// (behind a 300 ms spin); the buffer is then destroyed. RMM frees a `device_buffer` on its own
/// stream, so the pool cannot hand the memory out before that kernel ran. cuweave's rules say
/// the same thing ("work you queue by hand on `device_ptr()` must be recorded, or be on the
/// stream the buffer was allocated for"), and promise memory is never reused while queued work
/// can touch it.
///
/// The next buffer of the same pool is made on the legacy default stream (RMM's default
/// stream) and filled there. Expected: it holds its fill once everything has finished.
///
/// This failed on an H200 (every element overwritten) while `DeviceBuffer`'s drop deallocated a
/// resource buffer on the *legacy* stream after waiting only for the uses its tracker
/// recorded: the unrecorded kernel on the allocating stream was not among them and the legacy
/// stream does not wait for a non-blocking stream, so `cuMemFreeAsync` ran at once and the pool
/// handed the memory to the next legacy-stream allocation while the kernel was queued. The drop
/// now frees on the allocating stream (`buffer/device.rs`, `deallocate_on_home`).
#[test]
fn an_async_pool_buffer_written_late_on_its_own_stream_is_not_reused_before_that_write() {
    let name =
        "an_async_pool_buffer_written_late_on_its_own_stream_is_not_reused_before_that_write";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        name,
        "needs the legacy stream's fill to run beside the spin",
    ) {
        return;
    }
    let context = &gpu.context;
    let Some(pool) = async_pool_or_skip(name, context) else {
        return;
    };
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let kernels = TestKernels::load(context).expect("kernels");
    let legacy = Stream::legacy_default(context);
    const N: usize = MIB; // u32s: 4 MiB
    const STALE: u32 = 0xDEAD_BEEF;
    const FRESH: u32 = 0x600D_F00D;

    // A fresh stream each round, in case one shares a hardware queue with the legacy stream
    // (then its late write would land first and hide what the test looks for).
    for round in 0..3 {
        let owner = stream(context);
        let x = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &owner)
            .expect("x on its stream");
        kernels.spin_ns(&owner, 300 * MS).expect("spin");
        // SAFETY: `x` holds N u32s. The kernel is queued on the stream `x` was allocated on,
        // which the rules allow without recording, and `x` promises its memory is not reused
        // while queued work can touch it.
        unsafe { kernels.fill_u32(&owner, x.device_ptr(), STALE, N) }.expect("late write");
        let old = x.device_ptr();
        drop(x);

        let mut y = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &legacy)
            .expect("y on the default stream");
        let reused = y.device_ptr() == old;
        y.fill(FRESH).expect("fill y");
        let owner_was_busy = !owner.query().expect("query owner");
        owner.synchronize().expect("sync owner");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y hold the late write of the dropped x's \
             own-stream kernel (y got x's address: {reused}; x's stream still busy when y was \
             filled: {owner_was_busy})"
        );
        drop(y);
    }
    context.synchronize().expect("sync");
    assert_eq!(pool.outstanding(), 0, "every buffer went back to the pool");
}

/// The same program with the buffer outliving its stream: `x` is made on `owner`, written late
/// by an unrecorded kernel there, then `owner`'s handle is dropped (the stream is destroyed
/// once its work is done) and only then `x`. The free can no longer be queued on `owner`: the
/// legacy stream waits for the end event `owner`'s drop recorded behind its work, then frees
/// there. The next buffer of the pool, on the legacy stream, holds its fill.
#[test]
fn an_async_pool_buffer_outliving_its_stream_is_freed_after_that_streams_last_work() {
    let name = "an_async_pool_buffer_outliving_its_stream_is_freed_after_that_streams_last_work";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        name,
        "needs the legacy stream's fill to run beside the spin",
    ) {
        return;
    }
    let context = &gpu.context;
    let Some(pool) = async_pool_or_skip(name, context) else {
        return;
    };
    let resource: Arc<dyn MemoryResource> = pool.clone();
    let kernels = TestKernels::load(context).expect("kernels");
    let legacy = Stream::legacy_default(context);
    const N: usize = MIB; // u32s: 4 MiB
    const STALE: u32 = 0xDEAD_BEE5;
    const FRESH: u32 = 0x600D_F005;

    for round in 0..3 {
        let owner = stream(context);
        let x = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &owner)
            .expect("x on its stream");
        kernels.spin_ns(&owner, 300 * MS).expect("spin");
        // SAFETY: `x` holds N u32s; the kernel is queued on the stream `x` was allocated on,
        // before that stream's handle is dropped, which the rules allow without recording.
        unsafe { kernels.fill_u32(&owner, x.device_ptr(), STALE, N) }.expect("late write");
        let old = x.device_ptr();
        drop(owner);
        drop(x);

        let mut y = DeviceBuffer::<u32>::with_resource(Arc::clone(&resource), N, &legacy)
            .expect("y on the default stream");
        let reused = y.device_ptr() == old;
        y.fill(FRESH).expect("fill y");
        context.synchronize().expect("sync");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y hold the late write of the dropped x's \
             stream, dropped before x (y got x's address: {reused})"
        );
        drop(y);
    }
    context.synchronize().expect("sync");
    assert_eq!(pool.outstanding(), 0, "every buffer went back to the pool");
}

/// PyTorch / cudarc: `x = empty(n)` on stream `a`, a custom kernel on `a` writes `x` (queued on
/// the allocating stream, so left unrecorded as the rules allow), `del x`; then
/// `y = empty(n)` on `a` (the same cached block) is filled on a copy stream `b`. cuweave's
/// typed buffers order their uses across streams themselves, and the allocator docs promise a
/// block "returns to that stream's free list once those uses have finished ... so that whoever
/// gets it next may use it on any stream without racing the old work".
///
/// Expected: once everything has finished, `y` holds `b`'s fill.
///
/// This failed on an H200 (every element overwritten): a buffer with no recorded use hands its
/// block straight back to its stream's free list (right for a reuse on that stream), and a
/// cached buffer recorded nothing at its allocation, so `b` waited for nothing and the
/// still-queued kernel on `a` overwrote `y` after `b`'s fill. Now a cached buffer remembers its
/// allocation stream, and its first use on another stream waits for where that stream stands
/// (`buffer/tracker_origin.rs`); the hot path (allocate, use on one stream, drop) still records
/// no event.
#[test]
fn a_cached_block_written_late_on_its_own_stream_is_not_raced_by_the_next_buffer_elsewhere() {
    let name =
        "a_cached_block_written_late_on_its_own_stream_is_not_raced_by_the_next_buffer_elsewhere";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs b's fill to run beside a's spin") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    const N: usize = MIB;
    const STALE: u32 = 0x0BAD_CAFE;
    const FRESH: u32 = 0x1234_5678;

    // Fresh streams each round, in case two share a hardware queue (then b's fill would wait
    // behind a's work and hide what the test looks for).
    for round in 0..3 {
        let (a, b) = (stream(context), stream(context));
        let x = allocator.buffer::<u32>(N, &a).expect("x");
        kernels.spin_ns(&a, 300 * MS).expect("spin a");
        // SAFETY: `x` holds N u32s; the kernel is on the stream `x` was allocated for (allowed
        // unrecorded), and the memory is promised not to be reused under queued work.
        unsafe { kernels.fill_u32(&a, x.device_ptr(), STALE, N) }.expect("late write");
        let old = x.device_ptr();
        drop(x);

        let mut y = allocator
            .buffer::<u32>(N, &a)
            .expect("y, the next tensor on a");
        let reused = y.device_ptr() == old;
        y.fill_async(FRESH, &b).expect("fill y on b");
        b.synchronize().expect("sync b");
        let a_was_busy = !a.query().expect("query a");
        a.synchronize().expect("sync a");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y were overwritten by the dropped x's \
             kernel still queued on its own stream (y got x's block: {reused}; a still busy \
             after b's fill: {a_was_busy})"
        );
        drop(y);
    }
    context.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

/// The same program with the allocation stream's handle dropped between `y`'s allocation and
/// its first use on `b`: `b` can no longer wait for `a`, so it waits for the end event `a`'s
/// drop recorded behind all of `a`'s work, the late write included.
#[test]
fn a_cached_block_whose_stream_is_gone_orders_its_first_use_elsewhere_after_that_streams_end() {
    let name =
        "a_cached_block_whose_stream_is_gone_orders_its_first_use_elsewhere_after_that_streams_end";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs b's fill to run beside a's spin") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    const N: usize = MIB;
    const STALE: u32 = 0x0BAD_CAF5;
    const FRESH: u32 = 0x1234_5675;

    for round in 0..3 {
        let (a, b) = (stream(context), stream(context));
        let x = allocator.buffer::<u32>(N, &a).expect("x");
        kernels.spin_ns(&a, 300 * MS).expect("spin a");
        // SAFETY: `x` holds N u32s; the kernel is on the stream `x` was allocated for, queued
        // before that stream's handle is dropped (allowed unrecorded).
        unsafe { kernels.fill_u32(&a, x.device_ptr(), STALE, N) }.expect("late write");
        let old = x.device_ptr();
        drop(x);
        let mut y = allocator.buffer::<u32>(N, &a).expect("y on a");
        let reused = y.device_ptr() == old;
        drop(a);
        y.fill_async(FRESH, &b).expect("fill y on b");
        context.synchronize().expect("sync");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y were overwritten by the work of its \
             dropped allocation stream (y got x's block: {reused})"
        );
        drop(y);
    }
    context.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

/// `DeviceBuffer::new`'s stream, the legacy default one: `x` is written late there by an
/// unrecorded kernel (behind a spin), dropped, and the next buffer of the legacy stream gets its
/// block and is filled on a non-blocking stream `b`, which the legacy stream does not order.
/// `b`'s fill waits for the legacy stream first, so `y` holds it.
#[test]
fn a_cached_block_of_the_legacy_stream_is_not_raced_by_the_next_buffer_on_a_non_blocking_one() {
    let name =
        "a_cached_block_of_the_legacy_stream_is_not_raced_by_the_next_buffer_on_a_non_blocking_one";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        name,
        "needs b's fill to run beside the legacy stream's spin",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let legacy = Stream::legacy_default(context);
    const N: usize = MIB;
    const STALE: u32 = 0x0BAD_CAF6;
    const FRESH: u32 = 0x1234_5676;

    let b = stream(context);
    for round in 0..3 {
        let x = allocator.buffer::<u32>(N, &legacy).expect("x");
        kernels.spin_ns(&legacy, 300 * MS).expect("spin");
        // SAFETY: `x` holds N u32s; the kernel is on the stream `x` was allocated for.
        unsafe { kernels.fill_u32(&legacy, x.device_ptr(), STALE, N) }.expect("late write");
        let old = x.device_ptr();
        drop(x);
        let mut y = allocator.buffer::<u32>(N, &legacy).expect("y");
        let reused = y.device_ptr() == old;
        y.fill_async(FRESH, &b).expect("fill y on b");
        b.synchronize().expect("sync b");
        context.synchronize().expect("sync");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y were overwritten by the legacy stream's \
             late write (y got x's block: {reused})"
        );
        drop(y);
    }
    context.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// A borrowed handle of one raw stream per request
// ---------------------------------------------------------------------------------------------

/// One request of `one_raw_stream_borrowed_per_request_reuses_the_cache`: a 1 MiB buffer filled
/// and downloaded on `stream`, its bytes checked, then dropped.
fn one_request(allocator: &CachingAllocator, stream: &Stream, round: usize) {
    let value = (round % 251) as u8 + 1;
    let mut buffer = allocator.buffer::<u8>(MIB, stream).expect("buffer");
    buffer.fill_async(value, stream).expect("fill");
    let back = buffer
        .copy_to_host_async(vec![0u8; MIB], stream)
        .expect("download")
        .wait()
        .expect("downloaded");
    assert!(
        back.iter().all(|&byte| byte == value),
        "round {round}: the buffer did not hold its fill"
    );
    // Every event behind the buffer's uses has completed when it is freed: the next request's
    // allocation finds its block ready, whatever the timing.
    stream.synchronize().expect("sync");
}

/// `torch.cuda.ExternalStream(ptr)` / cudarc interop: a library called once per request wraps
/// the caller's raw `CUstream` in a borrowed handle (`Stream::from_raw(.., false)`), allocates
/// its scratch for it, and drops both. PyTorch's allocator keys its free lists by the raw
/// stream, so the second request reuses the first one's block.
///
/// Expected: 64 such requests of 1 MiB reserve what one request needs (a 2 MiB small-pool
/// segment, two at most), as the same loop on the owning handle does (checked first).
///
/// This failed on an H200 (64 misses, 128 MiB reserved) while the allocator keyed free lists by
/// the handle's process-unique id: every borrowed handle started an empty free list, and
/// borrowed handles are not watched for their end (`engine_ends.rs`), so no later miss adopted
/// their segments. Borrowed handles of one raw stream now share one key (`StreamKey::of`), and
/// their frees wait for an event on the stream instead of relying on stream order (the next
/// test shows why).
#[test]
fn one_raw_stream_borrowed_per_request_reuses_the_cache_instead_of_growing_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let owner = stream(context);
    const ROUNDS: usize = 64;

    let control = CachingAllocator::with_driver(context);
    for round in 0..ROUNDS {
        one_request(&control, &owner, round);
    }
    let control_stats = control.stats();
    assert!(
        control_stats.cache_misses <= 2,
        "the control (one owning handle) missed {} times",
        control_stats.cache_misses
    );

    let allocator = CachingAllocator::with_driver(context);
    for round in 0..ROUNDS {
        // SAFETY: `owner` outlives the handle, which does not own the stream (dropping it
        // destroys nothing).
        let borrowed = unsafe { Stream::from_raw(context, owner.as_raw(), false) };
        one_request(&allocator, &borrowed, round);
        drop(borrowed);
    }
    owner.synchronize().expect("sync");
    let stats = allocator.stats();
    let (misses, reserved) = (stats.cache_misses, stats.reserved_bytes.current);
    allocator.empty_cache().expect("empty");
    control.empty_cache().expect("empty control");
    assert!(
        misses <= 2 && reserved <= 4 * MIB,
        "{ROUNDS} requests on borrowed handles of one raw stream took {misses} new segments and \
         reserve {} MiB (the owning handle: {} miss(es), {} MiB)",
        reserved / MIB,
        control_stats.cache_misses,
        control_stats.reserved_bytes.current / MIB
    );
}

/// What sharing a borrowed stream's key must not allow: the owner of a raw stream destroys it
/// (allowed once no borrowed handle of it is left) while a dropped buffer's late write is
/// still queued there, and makes a new stream, which the driver often gives the old address.
/// A borrowed handle of the new stream has the old stream's key, so the old block is on its
/// free list; it must not come back before the old stream has passed the free, or the late
/// write lands in the new buffer. Rounds whose new stream got another address check the same
/// thing with nothing shared; at least one round must have reused the address, or the test
/// says it could not check (and skips).
#[test]
fn a_borrowed_streams_block_is_not_reused_by_a_new_stream_at_its_address_under_its_old_work() {
    let name =
        "a_borrowed_streams_block_is_not_reused_by_a_new_stream_at_its_address_under_its_old_work";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        name,
        "needs the new stream's fill to run beside the old spin",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    const N: usize = MIB; // u32s: 4 MiB
    const STALE: u32 = 0x0BAD_0BAD;
    const FRESH: u32 = 0x5AFE_5AFE;

    let mut recycled = 0;
    for round in 0..8 {
        let old_stream = stream(context);
        let raw = old_stream.as_raw();
        {
            // SAFETY: `old_stream` outlives the handle, which owns nothing.
            let borrowed = unsafe { Stream::from_raw(context, raw, false) };
            let x = allocator.buffer::<u32>(N, &borrowed).expect("x");
            kernels.spin_ns(&borrowed, 200 * MS).expect("spin");
            // SAFETY: `x` holds N u32s; the kernel is on the stream `x` was allocated on, queued
            // while its handle lives (allowed unrecorded).
            unsafe { kernels.fill_u32(&borrowed, x.device_ptr(), STALE, N) }.expect("late write");
            drop(x);
        }
        // No borrowed handle is left: the owner may destroy the stream (its work still runs).
        drop(old_stream);
        let new_stream = stream(context);
        let same_address = new_stream.as_raw() == raw;
        recycled += usize::from(same_address);
        // SAFETY: `new_stream` outlives the handle, which owns nothing.
        let borrowed = unsafe { Stream::from_raw(context, new_stream.as_raw(), false) };
        let mut y = allocator.buffer::<u32>(N, &borrowed).expect("y");
        y.fill_async(FRESH, &borrowed).expect("fill y");
        borrowed.synchronize().expect("sync the new stream");
        context.synchronize().expect("sync");
        let got = y.to_vec().expect("y");
        let stale = got.iter().filter(|&&v| v != FRESH).count();
        assert_eq!(
            stale, 0,
            "round {round}: {stale} of {N} elements of y were overwritten by the destroyed \
             stream's late write (new stream at the old address: {same_address})"
        );
        drop(y);
        drop(borrowed);
    }
    context.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    if recycled == 0 {
        skip(
            name,
            "the driver never gave a new stream a destroyed one's address: nothing shared",
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The books, byte for byte
// ---------------------------------------------------------------------------------------------

/// A tag byte for allocation `i`, never 0.
fn tag(i: usize) -> u8 {
    (i % 251) as u8 + 1
}

/// Writes `tag(i)` over the `size` bytes of `block` on `stream`.
fn stamp(block: &CachedAllocation, size: usize, i: usize, stream: &Stream) {
    // SAFETY: the block holds at least `size` bytes and outlives the memset (the stream is
    // synchronised before any block is freed).
    unsafe { memset_d8_async(block.ptr(), tag(i), size, stream) }.expect("memset");
}

/// `torch.cuda.memory_stats()` after allocating every small size class edge and 180 random
/// sizes from 1 B to 1 MiB on one stream: each block is the request rounded up to 512 B (the
/// small pool always splits), blocks never overlap and keep their own bytes, and
/// allocated / requested / active / reserved / segments / hits / misses reconcile exactly with
/// the requests and with a statistics adaptor under the cache. Freeing every other block keeps
/// the peaks; `reset_peak` sets them to the current values and they track the next high;
/// freeing everything zeroes what is held, and `empty_cache` gives every byte back.
#[test]
fn small_pool_books_reconcile_exactly_for_every_size_from_one_byte_to_one_mebibyte() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(counted.clone());
    let s = stream(context);

    let mut sizes: Vec<usize> = vec![
        1,
        2,
        511,
        512,
        513,
        1000,
        1023,
        1024,
        4095,
        4096,
        4097,
        65_535,
        65_536,
        65_537,
        262_143,
        262_144,
        524_287,
        524_289,
        MIB - 1,
        MIB,
    ];
    let mut state = 0x5EED_0001;
    for _ in 0..180 {
        sizes.push(1 + next(&mut state) % MIB);
    }
    let rounded_total: usize = sizes.iter().map(|&size| rounded(size)).sum();
    let requested_total: usize = sizes.iter().sum();

    let mut live: Vec<Option<CachedAllocation>> = Vec::with_capacity(sizes.len());
    for (i, &size) in sizes.iter().enumerate() {
        let block = allocator.allocate(size, &s).expect("allocate");
        assert_eq!(block.size(), size);
        assert_eq!(
            block.block_size(),
            rounded(size),
            "a {size} B request got a {} B block",
            block.block_size()
        );
        stamp(&block, size, i, &s);
        live.push(Some(block));
    }
    s.synchronize().expect("sync");
    let check_blocks = |live: &[Option<CachedAllocation>]| {
        let mut spans: Vec<(u64, usize)> = live
            .iter()
            .flatten()
            .map(|block| (block.ptr(), block.block_size()))
            .collect();
        spans.sort_unstable();
        for pair in spans.windows(2) {
            assert!(
                pair[0].0 + pair[0].1 as u64 <= pair[1].0,
                "blocks {:#x}+{} and {:#x} overlap",
                pair[0].0,
                pair[0].1,
                pair[1].0
            );
        }
        for (i, block) in live.iter().enumerate() {
            if let Some(block) = block {
                let size = sizes[i];
                assert_eq!(byte_at(context, block.ptr()), tag(i), "first byte of {i}");
                assert_eq!(
                    byte_at(context, block.ptr() + size as u64 - 1),
                    tag(i),
                    "last byte of {i} ({size} B)"
                );
            }
        }
    };
    check_blocks(&live);

    let stats = allocator.stats();
    let upstream = counted.stats();
    assert_eq!(stats.allocated_bytes.current, rounded_total);
    assert_eq!(stats.allocated_bytes.peak, rounded_total);
    assert_eq!(stats.requested_bytes.current, requested_total);
    assert_eq!(stats.active_bytes.current, rounded_total);
    assert_eq!(stats.allocations, sizes.len() as u64);
    assert_eq!(stats.frees, 0);
    assert_eq!(stats.cache_hits + stats.cache_misses, stats.allocations);
    assert_eq!(stats.cache_misses, stats.segments.current as u64);
    assert_eq!(
        stats.reserved_bytes.current,
        stats.segments.current * 2 * MIB
    );
    assert_eq!(upstream.current_bytes, stats.reserved_bytes.current);
    assert_eq!(upstream.total_allocations, stats.cache_misses);
    let waste = stats.reserved_bytes.current - rounded_total;
    assert!(
        waste < stats.segments.current * MIB + 2 * MIB,
        "best fit left {waste} B unused in {} segments for {rounded_total} B of blocks",
        stats.segments.current
    );
    let reserved = stats.reserved_bytes.current;

    // Free the even ones: the peaks stay, what is held drops by exactly their blocks.
    for block in live.iter_mut().step_by(2) {
        drop(block.take());
    }
    let evens_rounded: usize = sizes.iter().step_by(2).map(|&size| rounded(size)).sum();
    let evens_requested: usize = sizes.iter().step_by(2).sum();
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, rounded_total - evens_rounded);
    assert_eq!(
        stats.requested_bytes.current,
        requested_total - evens_requested
    );
    assert_eq!(stats.active_bytes.current, rounded_total - evens_rounded);
    assert_eq!(stats.allocated_bytes.peak, rounded_total);
    assert_eq!(stats.frees, sizes.len().div_ceil(2) as u64);
    assert_eq!(
        stats.reserved_bytes.current, reserved,
        "frees keep segments"
    );

    allocator.reset_peak();
    counted.reset_peak();
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.peak, stats.allocated_bytes.current);
    assert_eq!(stats.requested_bytes.peak, stats.requested_bytes.current);
    assert_eq!(stats.active_bytes.peak, stats.active_bytes.current);
    assert_eq!(stats.reserved_bytes.peak, stats.reserved_bytes.current);
    assert_eq!(stats.segments.peak, stats.segments.current);
    let upstream = counted.stats();
    assert_eq!(upstream.peak_bytes, upstream.current_bytes);
    assert_eq!(upstream.peak_allocations, upstream.current_allocations);

    // Allocate the even sizes again: the peak follows the new high.
    for (i, &size) in sizes.iter().enumerate().step_by(2) {
        let block = allocator.allocate(size, &s).expect("allocate again");
        assert_eq!(block.block_size(), rounded(size));
        stamp(&block, size, i, &s);
        live[i] = Some(block);
    }
    s.synchronize().expect("sync");
    check_blocks(&live);
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, rounded_total);
    assert_eq!(stats.allocated_bytes.peak, rounded_total);
    assert_eq!(stats.requested_bytes.current, requested_total);
    assert_eq!(stats.requested_bytes.peak, requested_total);
    assert_eq!(stats.cache_hits + stats.cache_misses, stats.allocations);
    assert_eq!(counted.stats().current_bytes, stats.reserved_bytes.current);
    assert_eq!(stats.reserved_bytes.peak, stats.reserved_bytes.current);

    drop(live);
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.requested_bytes.current, 0);
    assert_eq!(stats.active_bytes.current, 0);
    assert_eq!(stats.frees, stats.allocations);
    let held = stats.reserved_bytes.current;
    let segments = stats.segments.current as u64;
    let released = allocator.empty_cache().expect("empty_cache");
    assert_eq!(released, held, "empty_cache gives back every cached byte");
    let stats = allocator.stats();
    assert_eq!(
        (stats.reserved_bytes.current, stats.segments.current),
        (0, 0)
    );
    assert_eq!(stats.segments_released, segments);
    let upstream = counted.stats();
    assert_eq!(
        (upstream.current_bytes, upstream.current_allocations),
        (0, 0)
    );
    assert_eq!(upstream.total_deallocations, upstream.total_allocations);
}

/// The size table of the allocator docs, as a PyTorch user reads `memory_stats()` along it:
/// two 5 MiB blocks share a 20 MiB segment; once both are freed (the last one parked whole)
/// an 18 MiB request is served from that segment merged back together, not from a new one;
/// a 19.5 MiB request takes the whole 20 MiB block (a 0.5 MiB rest is not worth splitting),
/// counted as 20 MiB allocated and 19.5 MiB requested and writable to its last byte; on
/// another stream (whose free lists are its own) 10 MiB gets a segment of exactly 10 MiB,
/// 11 MiB + 1 B one of 12 MiB used whole, 3 MiB a 20 MiB segment, 1 MiB a 2 MiB small-pool
/// segment (even with 17 MiB free in the large pool) and 1 MiB + 1 B the large pool's free
/// rest. The upstream sees exactly those segments.
#[test]
fn large_pool_blocks_follow_the_size_table_and_the_stash_never_costs_a_segment() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(counted.clone());
    let (s1, s2) = (stream(context), stream(context));

    let a = allocator.allocate(5 * MIB, &s1).expect("a");
    let b = allocator.allocate(5 * MIB, &s1).expect("b");
    let base = a.ptr();
    assert_eq!(b.ptr(), base + 5 * MIB as u64, "b is carved after a");
    assert_eq!((a.block_size(), b.block_size()), (5 * MIB, 5 * MIB));
    assert_eq!(counted.stats().current_bytes, 20 * MIB);
    drop(a);
    drop(b);

    let c = allocator.allocate(18 * MIB, &s1).expect("c");
    assert_eq!(
        (c.ptr(), c.block_size()),
        (base, 18 * MIB),
        "18 MiB fits the merged 20 MiB segment"
    );
    assert_eq!(
        counted.stats().total_allocations,
        1,
        "no new segment for a request the freed blocks could serve once merged"
    );
    drop(c);

    const NINETEEN_AND_A_HALF: usize = 19 * MIB + 512 * KIB;
    let d = allocator.allocate(NINETEEN_AND_A_HALF, &s1).expect("d");
    assert_eq!((d.ptr(), d.block_size()), (base, 20 * MIB));
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 20 * MIB);
    assert_eq!(stats.requested_bytes.current, NINETEEN_AND_A_HALF);
    assert_eq!(counted.stats().total_allocations, 1);
    // Every byte of the block is the caller's.
    // SAFETY: `d` holds 20 MiB; the stream is synchronised before it is freed.
    unsafe { memset_d32_async(d.ptr(), 0xD0D0_D0D0, 5 * MIB, &s1) }.expect("fill d");
    s1.synchronize().expect("sync");
    assert_eq!(word_at(context, d.ptr() + 20 * MIB as u64 - 4), 0xD0D0_D0D0);
    drop(d);

    let e = allocator.allocate(10 * MIB, &s2).expect("e");
    assert_eq!(e.block_size(), 10 * MIB);
    assert_eq!(
        counted.stats().current_bytes,
        30 * MIB,
        "10 MiB -> a 10 MiB segment"
    );
    let f = allocator.allocate(11 * MIB + 1, &s2).expect("f");
    assert_eq!(
        f.block_size(),
        12 * MIB,
        "11 MiB + 512 B in a 12 MiB segment, used whole"
    );
    assert_eq!(counted.stats().current_bytes, 42 * MIB);
    let g = allocator.allocate(3 * MIB, &s2).expect("g");
    assert_eq!(g.block_size(), 3 * MIB);
    assert_eq!(
        counted.stats().current_bytes,
        62 * MIB,
        "3 MiB -> a 20 MiB segment"
    );
    let h = allocator.allocate(MIB, &s2).expect("h");
    assert_eq!(h.block_size(), MIB);
    assert_eq!(
        counted.stats().current_bytes,
        64 * MIB,
        "1 MiB is small: a 2 MiB segment"
    );
    let i = allocator.allocate(MIB + 1, &s2).expect("i");
    assert_eq!(
        (i.ptr(), i.block_size()),
        (g.ptr() + 3 * MIB as u64, MIB + 512),
        "1 MiB + 1 B is large: carved from g's segment"
    );
    // SAFETY: `f` holds 12 MiB; the stream is synchronised before it is freed.
    unsafe { memset_d32_async(f.ptr(), 0xF0F0_F0F0, 3 * MIB, &s2) }.expect("fill f");
    s2.synchronize().expect("sync");
    assert_eq!(word_at(context, f.ptr() + 12 * MIB as u64 - 4), 0xF0F0_F0F0);

    let stats = allocator.stats();
    assert_eq!(stats.segments.current, 5);
    assert_eq!(stats.reserved_bytes.current, 64 * MIB);
    assert_eq!(stats.cache_misses, 5);
    assert_eq!(stats.allocations, 9);
    assert_eq!(stats.cache_hits, 4);
    assert_eq!(
        stats.allocated_bytes.current,
        10 * MIB + 12 * MIB + 3 * MIB + MIB + MIB + 512
    );
    assert_eq!(counted.stats().total_allocations, 5);
    drop((e, f, g, h, i));
    assert_eq!(allocator.empty_cache().expect("empty"), 64 * MIB);
    assert_eq!(counted.stats().current_bytes, 0);
}

// ---------------------------------------------------------------------------------------------
// record_stream, pending frees and active bytes
// ---------------------------------------------------------------------------------------------

/// `x.record_stream(side); del x` while a kernel on `side` still reads `x` (a 300 ms watch):
/// PyTorch counts the block in `active_bytes` (not `allocated_bytes`) until `side` is past
/// the free, and never hands it out meanwhile. The next request on `x`'s stream gets other
/// memory, the watch sees no byte change, and once `side` is done the next allocation's poll
/// retires the pending block: `active == allocated` again and nothing is pending.
#[test]
fn a_record_stream_free_counts_as_active_until_the_reader_ends_and_then_reconciles() {
    let name = "a_record_stream_free_counts_as_active_until_the_reader_ends_and_then_reconciles";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(
        name,
        "needs the watch to overlap the next allocation's fill",
    ) {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let counters = CachingAllocator::with_driver(context);
    let a = stream(context);
    let side = Arc::new(stream(context));
    const N: usize = MIB; // u32s
    const VALUE: u32 = 0x5A5A_1234;

    let mismatches = counters.allocate(4, &side).expect("counter");
    let mut x = allocator.allocate(N * 4, &a).expect("x");
    // SAFETY: `x` holds N u32s and `mismatches` one; both outlive the queued work (the streams
    // are synchronised before the counter is freed; `x`'s block is held by record_stream).
    unsafe {
        memset_d32_async(x.ptr(), VALUE, N, &a).expect("fill x");
        memset_d32_async(mismatches.ptr(), 0, 1, &side).expect("zero counter");
    }
    let filled = Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
    filled.record(&a).expect("record");
    side.wait_event(&filled).expect("side waits for the fill");
    // SAFETY: as above.
    unsafe { kernels.watch_u32(&side, x.ptr(), N, VALUE, 300 * MS, mismatches.ptr()) }
        .expect("watch");
    x.record_stream(&side).expect("record_stream");
    let (old, block) = (x.ptr(), x.block_size());
    drop(x);

    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.requested_bytes.current, 0);
    assert_eq!(
        stats.active_bytes.current, block,
        "a pending block is active"
    );
    assert_eq!(stats.frees, 1);
    assert_eq!(allocator.pending_frees(), 1);

    let y = allocator.allocate(N * 4, &a).expect("y while side reads x");
    assert!(
        !overlaps(y.ptr(), y.block_size(), old, block),
        "y ({:#x}) overlaps x's pending block ({old:#x})",
        y.ptr()
    );
    // SAFETY: `y` holds N u32s and is freed after the stream is synchronised.
    unsafe { memset_d32_async(y.ptr(), !VALUE, N, &a) }.expect("fill y");
    a.synchronize().expect("sync a");
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, y.block_size());
    assert_eq!(stats.active_bytes.current, y.block_size() + block);

    side.synchronize().expect("sync side");
    assert_eq!(
        word_at(context, mismatches.ptr()),
        0,
        "the watch on side saw x's bytes change"
    );
    let z = allocator
        .allocate(4 * KIB, &a)
        .expect("z polls the pending free");
    assert_eq!(
        allocator.pending_frees(),
        0,
        "side is done: nothing pending"
    );
    let stats = allocator.stats();
    assert_eq!(stats.active_bytes.current, stats.allocated_bytes.current);
    assert_eq!(
        stats.allocated_bytes.current,
        y.block_size() + z.block_size()
    );
    drop((y, z, mismatches));
    assert_eq!(allocator.stats().active_bytes.current, 0);
}

/// A request server: each request's stream owns its tensors, one of which a long-lived
/// reader stream is still reading (recorded with `record_stream`) when the request ends and its
/// stream is dropped. The next request's miss must not take the dropped stream's segment while
/// the reader runs (the watch sees nothing), and once the reader is done a miss adopts that
/// segment instead of asking the driver: two segments in all, the second request's 18 MiB
/// tensor at the first request's address.
#[test]
fn a_dropped_streams_segment_waits_for_its_slow_reader_then_serves_the_next_miss() {
    let name = "a_dropped_streams_segment_waits_for_its_slow_reader_then_serves_the_next_miss";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs the watch to overlap the next request's fill") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let counted = Arc::new(StatisticsAdaptor::new(DriverResource::new(context)));
    let allocator = CachingAllocator::new(counted.clone());
    let counters = CachingAllocator::with_driver(context);
    let reader = Arc::new(stream(context));
    const N: usize = 2 * MIB; // u32s: 8 MiB
    const VALUE: u32 = 0x7777_0001;

    let mismatches = counters.allocate(4, &reader).expect("counter");
    let owner = stream(context);
    let mut x = allocator.allocate(N * 4, &owner).expect("x");
    let old = x.ptr();
    // SAFETY: `x` holds N u32s, `mismatches` one; `x`'s block is held by record_stream until
    // the reader is past it, and the counter outlives the synchronisation below.
    unsafe {
        memset_d32_async(x.ptr(), VALUE, N, &owner).expect("fill x");
        memset_d32_async(mismatches.ptr(), 0, 1, &reader).expect("zero");
    }
    let filled = Event::new(context, EventFlags::DISABLE_TIMING).expect("event");
    filled.record(&owner).expect("record");
    reader.wait_event(&filled).expect("wait");
    // SAFETY: as above.
    unsafe { kernels.watch_u32(&reader, x.ptr(), N, VALUE, 300 * MS, mismatches.ptr()) }
        .expect("watch");
    x.record_stream(&reader).expect("record_stream");
    drop(x);
    drop(owner);

    let next = stream(context);
    let y = allocator.allocate(N * 4, &next).expect("y");
    assert!(
        !overlaps(y.ptr(), N * 4, old, 20 * MIB),
        "the next request's tensor ({:#x}) is in the dropped stream's segment ({old:#x}) \
         while the reader still reads it",
        y.ptr()
    );
    // SAFETY: `y` holds N u32s and is freed after its stream is synchronised.
    unsafe { memset_d32_async(y.ptr(), !VALUE, N, &next) }.expect("fill y");
    next.synchronize().expect("sync next");
    reader.synchronize().expect("sync reader");
    assert_eq!(
        word_at(context, mismatches.ptr()),
        0,
        "the reader saw x change"
    );
    assert_eq!(counted.stats().total_allocations, 2);

    // 18 MiB does not fit the 12 MiB left of y's segment: the miss adopts the dropped stream's
    // segment, now wholly free.
    let z = allocator.allocate(18 * MIB, &next).expect("z");
    assert_eq!(
        z.ptr(),
        old,
        "the miss did not reuse the dropped stream's segment"
    );
    let stats = allocator.stats();
    assert_eq!(counted.stats().total_allocations, 2, "no third segment");
    assert_eq!(stats.reserved_bytes.current, 40 * MIB);
    assert_eq!(stats.cache_misses, 2);
    assert_eq!(allocator.pending_frees(), 0);
    drop((y, z, mismatches));
    allocator.empty_cache().expect("empty");
    assert_eq!(counted.stats().current_bytes, 0);
}

/// `x[:n].record_stream(s1); x[n:].record_stream(s2)` in typed form: two views of one buffer
/// read by slow kernels on two other streams (declared with the views' `prepare_read` /
/// `record_read`), the buffer dropped at once. Its block must wait for both readers: a new
/// buffer on the allocating stream gets other memory and its fill reaches neither reader;
/// once both are done the block comes back at its address.
#[test]
fn views_read_on_two_streams_hold_their_buffers_block_until_both_readers_end() {
    let name = "views_read_on_two_streams_hold_their_buffers_block_until_both_readers_end";
    let gpu = require_gpu!();
    let _serial = serial();
    if skip_under_sanitizer(name, "needs the readers to overlap the next buffer's fill") {
        return;
    }
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    let scratch = CachingAllocator::with_driver(context);
    let (a, b, c) = (stream(context), stream(context), stream(context));
    const HALF: usize = MIB; // u32s: 4 MiB per view
    const VALUE: u32 = 0x3C3C_0042;

    let mut counters = scratch.buffer::<u32>(2, &a).expect("counters");
    counters.fill_async(0, &a).expect("zero counters");
    let mut x = allocator.buffer::<u32>(2 * HALF, &a).expect("x");
    x.fill_async(VALUE, &a).expect("fill x");
    a.synchronize().expect("sync a");
    let counter_ptr = counters.device_ptr();
    {
        let low = x.slice(..HALF).expect("low view");
        low.prepare_read(&b).expect("prepare low");
        // SAFETY: the view holds HALF u32s and the counter one; the view's read is recorded
        // below, so the buffer's block outlives the kernel; the counter is read after `b` is
        // synchronised.
        unsafe { kernels.watch_u32(&b, low.device_ptr(), HALF, VALUE, 300 * MS, counter_ptr) }
            .expect("watch low");
        low.record_read(&b).expect("record low");
        let high = x.slice(HALF..).expect("high view");
        high.prepare_read(&c).expect("prepare high");
        // SAFETY: as above, for the other half and the other counter.
        unsafe {
            kernels.watch_u32(
                &c,
                high.device_ptr(),
                HALF,
                VALUE,
                150 * MS,
                counter_ptr + 4,
            )
        }
        .expect("watch high");
        high.record_read(&c).expect("record high");
    }
    let (old, bytes) = (x.device_ptr(), x.allocated_bytes());
    drop(x);

    let mut y = allocator.buffer::<u32>(2 * HALF, &a).expect("y");
    assert!(
        !overlaps(y.device_ptr(), y.allocated_bytes(), old, bytes),
        "y got the block two readers still read"
    );
    y.fill_async(!VALUE, &a).expect("fill y");
    a.synchronize().expect("sync a");
    b.synchronize().expect("sync b");
    c.synchronize().expect("sync c");
    assert_eq!(
        counters.to_vec().expect("counters"),
        vec![0, 0],
        "a reader of a view saw its bytes change"
    );
    let z = allocator.buffer::<u32>(2 * HALF, &a).expect("z");
    assert_eq!(
        z.device_ptr(),
        old,
        "the block came back once both readers were done"
    );
    drop((y, z));
    a.synchronize().expect("sync");
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
    // `y` was filled, so its block went back behind that fill's event; pending frees are
    // polled at the next allocation on their stream's shard (docs/allocators.md), not when the
    // event completes, so one is still listed until then.
    drop(
        allocator
            .buffer::<u32>(2 * HALF, &a)
            .expect("the next allocation polls"),
    );
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(allocator.stats().allocated_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// Many threads, many buffers
// ---------------------------------------------------------------------------------------------

/// A tag for thread `thread`'s iteration `iteration` (below 2^24).
fn thread_tag(thread: usize, iteration: usize) -> u32 {
    ((thread as u32 + 1) << 24) | iteration as u32
}

/// Eight request threads, each on its own stream, each making ten thousand buffers of random
/// sizes (mostly small, every 97th in the large pool) from one allocator: fill, a checksum
/// kernel into a per-iteration slot, drop at once (the block is reused while the checksum may
/// still be queued, on the same stream). The host synchronises only every 256 iterations. Every
/// one of the 80 000 checksums equals what its buffer was filled with, and the books balance.
#[test]
fn eight_threads_churn_ten_thousand_buffers_each_and_every_checksum_matches_its_fill() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let kernels = TestKernels::load(context).expect("kernels");
    let allocator = CachingAllocator::with_driver(context);
    const THREADS: usize = 8;
    const ITERATIONS: usize = 10_000;
    const SYNC_EVERY: usize = 256;

    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let (allocator, kernels, context) = (&allocator, &kernels, context);
            scope.spawn(move || {
                let s = stream(context);
                let mut sums = allocator.buffer::<u64>(ITERATIONS, &s).expect("sums");
                sums.fill_async(0, &s).expect("zero sums");
                let mut lens = Vec::with_capacity(ITERATIONS);
                let mut state = 0xC0FF_EE00 + thread as u64;
                for iteration in 0..ITERATIONS {
                    let len = if iteration % 97 == 0 {
                        300_000
                    } else {
                        1 + next(&mut state) % (16 * 1024)
                    };
                    lens.push(len);
                    let mut buffer = allocator.buffer::<u32>(len, &s).expect("buffer");
                    buffer
                        .fill_async(thread_tag(thread, iteration), &s)
                        .expect("fill");
                    let slot = sums.device_ptr() + 8 * iteration as u64;
                    // SAFETY: `buffer` holds `len` u32s and `slot` is one u64 of `sums`; both
                    // are used on the stream they were allocated for, so the blocks are reused
                    // only by work queued after the checksum; `sums` is read after a
                    // synchronisation.
                    unsafe { kernels.checksum_u32(&s, buffer.device_ptr(), len, slot) }
                        .expect("checksum");
                    drop(buffer);
                    if iteration % SYNC_EVERY == SYNC_EVERY - 1 {
                        s.synchronize().expect("sync");
                    }
                }
                s.synchronize().expect("sync");
                let got = sums.to_vec().expect("sums");
                for (iteration, (&sum, &len)) in got.iter().zip(&lens).enumerate() {
                    let expected = u64::from(thread_tag(thread, iteration)) * len as u64;
                    assert_eq!(
                        sum, expected,
                        "thread {thread} iteration {iteration}: a buffer of {len} elements \
                         summed to {sum}, not {expected}"
                    );
                }
            });
        }
    });
    let stats = allocator.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.requested_bytes.current, 0);
    assert_eq!(
        stats.allocations,
        (THREADS * (ITERATIONS + 1)) as u64,
        "every buffer was counted"
    );
    assert_eq!(stats.frees, stats.allocations);
    allocator.empty_cache().expect("empty");
    let stats = allocator.stats();
    assert_eq!(allocator.pending_frees(), 0);
    assert_eq!(stats.active_bytes.current, 0);
    assert_eq!(stats.reserved_bytes.current, 0);
}

// ---------------------------------------------------------------------------------------------
// Replacing the default allocator mid-program
// ---------------------------------------------------------------------------------------------

/// Restores the device's default allocator when dropped, even if the test fails.
struct RestoreDefault(Option<CachingAllocator>);

impl Drop for RestoreDefault {
    fn drop(&mut self) {
        if let Some(original) = self.0.take() {
            CachingAllocator::set_default_for_device(original);
        }
    }
}

/// `torch.cuda.set_per_process_memory_fraction` in the middle of a run: a worker thread has
/// already allocated from the default allocator (and cached its clone), then the main thread
/// installs a default over a 32 MiB limit. The worker's next `DeviceBuffer::new_on` must come
/// from the new default: 64 MiB is a typed out-of-memory naming the 32 MiB cap, 8 MiB works and
/// shows in the new allocator's books. The original default is put back afterwards.
#[test]
fn a_default_allocator_replaced_mid_program_serves_a_thread_that_used_the_old_one() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let original = CachingAllocator::for_device(gpu.device).expect("default");
    let restore = RestoreDefault(Some(original.clone()));
    const CAP: usize = 32 * MIB;
    let limited = CachingAllocator::new(Arc::new(LimitAdaptor::new(
        DriverResource::new(context),
        CAP,
    )));
    let (warmed_tx, warmed_rx) = mpsc::channel();
    let (replaced_tx, replaced_rx) = mpsc::channel::<()>();
    let worker_done = AtomicBool::new(false);
    let start = Barrier::new(2);

    std::thread::scope(|scope| {
        let (start, worker_done) = (&start, &worker_done);
        // Each side owns its channel ends, so a panic on either side closes them and the other
        // side's wait ends instead of hanging the scope.
        let replaced_tx = replaced_tx;
        scope.spawn(move || {
            start.wait();
            let s = stream(context);
            let warm = DeviceBuffer::<u8>::new_on(&s, MIB).expect("from the first default");
            drop(warm);
            warmed_tx.send(()).expect("tell main");
            replaced_rx.recv().expect("main replaced the default");
            match DeviceBuffer::<u8>::new_on(&s, 64 * MIB) {
                Err(MemoryError::OutOfMemory { limit, .. }) => {
                    assert_eq!(limit, Some(CAP), "the refusal names the new default's cap")
                }
                Err(other) => panic!("64 MiB under a 32 MiB default: {other}"),
                Ok(_) => {
                    panic!("64 MiB came from the replaced default after a 32 MiB one was installed")
                }
            }
            let mut ok = DeviceBuffer::<u32>::new_on(&s, 2 * MIB).expect("8 MiB fits the cap");
            ok.fill_async(9, &s).expect("fill");
            assert!(ok.to_vec().expect("read").iter().all(|&v| v == 9));
            drop(ok);
            s.synchronize().expect("sync");
            worker_done.store(true, Ordering::SeqCst);
        });
        start.wait();
        warmed_rx.recv().expect("the worker warmed its default");
        let previous = CachingAllocator::set_default_for_device(limited.clone());
        replaced_tx.send(()).expect("tell the worker");
        assert!(previous.is_some(), "a default was installed before");
    });
    assert!(worker_done.load(Ordering::SeqCst));
    let stats = limited.stats();
    assert_eq!(
        stats.allocations, 1,
        "the 8 MiB buffer came from the new default"
    );
    assert_eq!(stats.ooms, 1, "the 64 MiB request was refused by it");
    drop(restore);
    let back = CachingAllocator::for_device(gpu.device).expect("default");
    let s = stream(context);
    let big = DeviceBuffer::<u8>::new_on(&s, 64 * MIB).expect("the original default again");
    drop(big);
    assert!(back.stats().allocations >= 1);
    limited.empty_cache().expect("empty");
    back.empty_cache().expect("empty the default");
}
