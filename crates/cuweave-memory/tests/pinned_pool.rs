//! The pinned pool on a real GPU: blocks come back without pinning again, never while a stream
//! that used them still runs, carry bytes to the device and back, are unpinned by `trim`, and
//! survive eight threads sharing the pool.
//!
//! Each GPU test takes [`serial`]: several assert that the driver no longer knows a freed
//! address, which holds only while no other test pins memory (the OS reuses freed address
//! ranges), and the timing-based ones must not share the GPU with other tests' kernels.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use cuweave_driver::memory::{self, DeviceAllocation, MemoryType};
use cuweave_driver::{Context, DriverError, Stream, StreamFlags};
use cuweave_memory::MemoryError;
use cuweave_memory::pinned_pool::{
    PinnedBlock, PinnedPool, PinnedPoolConfig, PinnedPoolStats, TypedPinnedBlock,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const MS: u64 = 1_000_000;
/// How long a spin kernel keeps a stream busy: far longer than pinning a 16 MiB block takes.
const SPIN_NS: u64 = 100 * MS;

static SERIAL: Mutex<()> = Mutex::new(());

/// Runs GPU tests of this file one at a time (see the file's docs).
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Loaded kernels and a non-blocking stream, with one launch done so that lazy module loading is
/// paid for before a spin is timed against host work.
fn warmed_up(context: &Arc<Context>) -> (TestKernels, Stream) {
    let kernels = TestKernels::load(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&stream, 0).unwrap();
    stream.synchronize().unwrap();
    (kernels, stream)
}

fn address(block: &PinnedBlock) -> usize {
    block.as_slice().as_ptr() as usize
}

/// Whether the driver knows `address` as pinned host memory (`false`: it was unpinned).
fn driver_knows_pinned(address: usize) -> bool {
    match memory::pointer_attributes(address as u64) {
        Ok(attributes) => {
            assert_eq!(attributes.memory_type, MemoryType::Host);
            true
        }
        Err(error) => {
            assert_eq!(
                error.code(),
                Some(cuweave_driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE),
                "{error}"
            );
            false
        }
    }
}

fn assert_balanced(stats: &PinnedPoolStats) {
    assert_eq!(
        stats.pinned_bytes,
        stats.allocated_bytes + stats.cached_bytes,
        "{stats:?}"
    );
    assert_eq!(stats.gets, stats.hits + stats.misses, "{stats:?}");
    assert!(stats.pending_bytes <= stats.cached_bytes, "{stats:?}");
}

#[test]
fn pool_and_blocks_are_send_and_sync() {
    fn shareable<T: Send + Sync>() {}
    shareable::<PinnedPool>();
    shareable::<PinnedBlock>();
    shareable::<TypedPinnedBlock<f64>>();
}

#[test]
fn bad_requests_are_typed_errors_and_pin_nothing() {
    let gpu = require_gpu!();
    let _serial = serial();
    let pool = PinnedPool::new(&gpu.context);
    assert!(matches!(
        pool.get(0),
        Err(MemoryError::ZeroLength {
            operation: "PinnedPool::get"
        })
    ));
    assert!(matches!(
        pool.get_typed::<u32>(0),
        Err(MemoryError::ZeroLength {
            operation: "PinnedPool::get_typed"
        })
    ));
    assert!(matches!(
        pool.get_typed::<()>(16),
        Err(MemoryError::ZeroLength { .. })
    ));
    match pool.get(usize::MAX) {
        Err(error @ MemoryError::OutOfMemory { requested, .. }) => {
            assert_eq!(requested, usize::MAX);
            assert!(error.is_out_of_memory());
        }
        other => panic!("get(usize::MAX) gave {other:?}"),
    }
    assert!(matches!(
        pool.get_typed::<u64>(usize::MAX),
        Err(MemoryError::Misaligned {
            element_size: 8,
            ..
        })
    ));
    assert_eq!(pool.stats(), PinnedPoolStats::default());
}

#[test]
fn a_returned_block_comes_back_without_pinning_again() {
    let gpu = require_gpu!();
    let _serial = serial();
    let pool = PinnedPool::new(&gpu.context);
    let first = pool.get(16 * MIB).unwrap();
    assert_eq!((first.len(), first.capacity()), (16 * MIB, 16 * MIB));
    let first_address = address(&first);
    assert_eq!(
        first_address % (4 * KIB),
        0,
        "pinned blocks are page-aligned"
    );
    assert!(driver_knows_pinned(first_address));
    drop(first);

    // A smaller request of the same class gets the same block, cut to the requested length.
    let second = pool.get(16 * MIB - 100).unwrap();
    assert_eq!(address(&second), first_address);
    assert_eq!(
        (second.len(), second.capacity()),
        (16 * MIB - 100, 16 * MIB)
    );

    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!(
        (stats.gets, stats.hits, stats.misses, stats.returns),
        (2, 1, 1, 1)
    );
    assert_eq!(stats.pinned_bytes, 16 * MIB, "no second pin");
    assert_eq!(stats.peak_pinned_bytes, 16 * MIB);
    assert_eq!((stats.allocated_bytes, stats.cached_bytes), (16 * MIB, 0));
}

#[test]
fn a_block_is_not_reused_while_a_recorded_stream_still_runs() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (kernels, stream) = warmed_up(&gpu.context);
    let pool = PinnedPool::new(&gpu.context);

    let mut first = pool.get(16 * MIB).unwrap();
    let first_address = address(&first);
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    first.record(&stream).unwrap();
    assert_eq!(first.recorded_uses(), 1);
    drop(first);

    let second = pool.get(16 * MIB).unwrap();
    assert!(
        !stream.query().unwrap(),
        "the spin kernel ended before the second get: the test proves nothing"
    );
    assert_ne!(
        address(&second),
        first_address,
        "reused under a running kernel"
    );
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!((stats.hits, stats.misses), (0, 2));
    assert_eq!((stats.pending_blocks, stats.pending_bytes), (1, 16 * MIB));
    assert_eq!(stats.pinned_bytes, 32 * MIB);

    stream.synchronize().unwrap();
    // `second` is still held, so the only candidate is the first block, now past its use.
    let third = pool.get(16 * MIB).unwrap();
    assert_eq!(address(&third), first_address);
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!((stats.hits, stats.misses), (1, 2));
    assert_eq!((stats.pending_blocks, stats.cached_bytes), (0, 0));
    assert_eq!(stats.allocated_bytes, 32 * MIB);
}

#[test]
fn a_block_recorded_on_two_streams_waits_for_both() {
    let gpu = require_gpu!();
    if cuweave_test_support::skip_under_sanitizer(
        "pinned_pool::a_block_recorded_on_two_streams_waits_for_both",
        "needs the slow stream to still run while the quick one has finished",
    ) {
        return;
    }
    let _serial = serial();
    let (kernels, slow) = warmed_up(&gpu.context);
    let quick = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let pool = PinnedPool::new(&gpu.context);

    let mut block = pool.get(MIB).unwrap();
    let block_address = address(&block);
    kernels.spin_ns(&slow, SPIN_NS).unwrap();
    kernels.spin_ns(&quick, 0).unwrap();
    block.record(&quick).unwrap();
    block.record(&slow).unwrap();
    assert_eq!(block.recorded_uses(), 2);
    drop(block);

    quick.synchronize().unwrap();
    let while_slow_runs = pool.get(MIB).unwrap();
    assert!(
        !slow.query().unwrap(),
        "the slow stream ended too early to prove anything"
    );
    assert_ne!(address(&while_slow_runs), block_address);

    slow.synchronize().unwrap();
    let after_both = pool.get(MIB).unwrap();
    assert_eq!(address(&after_both), block_address);
    assert_eq!(pool.stats().hits, 1);
}

#[test]
fn bytes_round_trip_between_pool_blocks_and_the_device() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (kernels, stream) = warmed_up(&gpu.context);
    let pool = PinnedPool::new(&gpu.context);
    const WORDS: usize = 3 * MIB / 4 + 5;
    let bytes = WORDS * size_of::<u32>();

    let mut upload = pool.get_typed::<u32>(WORDS).unwrap();
    assert_eq!((upload.len(), upload.byte_len()), (WORDS, bytes));
    for (i, word) in upload.as_mut_slice().iter_mut().enumerate() {
        *word = (i as u32).wrapping_mul(0x9E37_79B9);
    }
    let mut download = pool.get_typed::<u32>(WORDS).unwrap();
    download.as_mut_slice().fill(0xEEEE_EEEE);
    let device = DeviceAllocation::new(&gpu.context, bytes).unwrap();

    // SAFETY: `upload` holds `bytes` bytes and is neither written nor dropped before the
    // synchronize below; `device` is `bytes` long and outlives it.
    unsafe {
        memory::copy_htod_async(
            device.ptr(),
            upload.as_slice().as_ptr().cast(),
            bytes,
            &stream,
        )
    }
    .unwrap();
    upload.record(&stream).unwrap();
    // SAFETY: `device` holds WORDS u32s, touched by nothing else until the synchronize.
    unsafe { kernels.increment_u32(&stream, device.ptr(), WORDS) }.unwrap();
    // SAFETY: `download` holds `bytes` bytes, neither read nor dropped before the synchronize.
    unsafe {
        memory::copy_dtoh_async(
            download.as_mut_slice().as_mut_ptr().cast(),
            device.ptr(),
            bytes,
            &stream,
        )
    }
    .unwrap();
    download.record(&stream).unwrap();
    stream.synchronize().unwrap();

    let sent = upload.as_slice();
    let received = download.as_slice();
    for (i, (&out, &back)) in sent.iter().zip(received).enumerate() {
        assert_eq!(back, out.wrapping_add(1), "word {i}");
    }
}

#[test]
fn mapped_blocks_are_written_by_kernels_in_place() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (kernels, stream) = warmed_up(&gpu.context);
    let config = PinnedPoolConfig {
        mapped: true,
        ..PinnedPoolConfig::default()
    };
    let pool = PinnedPool::with_config(&gpu.context, config);
    const WORDS: usize = 4096;
    let mut block = pool.get_typed::<u32>(WORDS).unwrap();
    assert!(block.block().is_mapped());
    block.as_mut_slice().fill(0);
    let device_view = block.device_ptr().unwrap();
    // SAFETY: `device_view` maps the WORDS u32s of `block`, which the host does not touch and
    // which stay alive until the synchronize.
    unsafe { kernels.fill_u32(&stream, device_view, 0x00C0_FFEE, WORDS) }.unwrap();
    block.record(&stream).unwrap();
    stream.synchronize().unwrap();
    assert!(block.as_slice().iter().all(|&word| word == 0x00C0_FFEE));

    let unmapped = PinnedPool::new(&gpu.context).get(WORDS).unwrap();
    assert!(!unmapped.is_mapped());
    assert!(matches!(
        unmapped.device_ptr(),
        Err(MemoryError::Driver(DriverError::InvalidArgument { .. }))
    ));
}

#[test]
fn trim_unpins_ready_blocks_and_keeps_those_a_stream_still_uses() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (kernels, stream) = warmed_up(&gpu.context);
    let pool = PinnedPool::new(&gpu.context);
    let held = pool.get(MIB).unwrap();
    let returned: Vec<_> = [4 * MIB, 16 * MIB, 64 * KIB]
        .into_iter()
        .map(|bytes| pool.get(bytes).unwrap())
        .collect();
    // Blocks of 4 MiB and more are their own allocations in the driver, so unpinning them makes
    // their addresses unknown to it.
    let large: Vec<usize> = returned[..2].iter().map(address).collect();
    drop(returned);
    let cached = 4 * MIB + 16 * MIB + 64 * KIB;
    let stats = pool.stats();
    assert_eq!((stats.cached_bytes, stats.cached_blocks), (cached, 3));
    assert_eq!(stats.pinned_bytes, cached + MIB);

    assert_eq!(pool.trim(), cached);
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!(
        (stats.cached_bytes, stats.cached_blocks, stats.frees),
        (0, 0, 3)
    );
    assert_eq!(
        stats.pinned_bytes, MIB,
        "only the block in use stays pinned"
    );
    for &unpinned in &large {
        assert!(
            !driver_knows_pinned(unpinned),
            "{unpinned:#x} is still pinned"
        );
    }
    assert!(driver_knows_pinned(address(&held)));

    // A block a running kernel's stream was recorded on survives trim until the stream passes.
    let mut busy = pool.get(8 * MIB).unwrap();
    let busy_address = address(&busy);
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    busy.record(&stream).unwrap();
    drop(busy);
    assert_eq!(pool.trim(), 0);
    assert!(
        !stream.query().unwrap(),
        "the kernel ended before trim: proves nothing"
    );
    assert!(driver_knows_pinned(busy_address));
    assert_eq!(pool.stats().pending_bytes, 8 * MIB);

    stream.synchronize().unwrap();
    assert_eq!(pool.trim(), 8 * MIB);
    assert!(!driver_knows_pinned(busy_address));
    drop(held);
    assert_eq!(pool.trim(), MIB);
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!(
        (stats.pinned_bytes, stats.cached_bytes, stats.pending_blocks),
        (0, 0, 0)
    );
    assert_eq!(stats.peak_pinned_bytes, cached + MIB);
}

#[test]
fn blocks_that_do_not_fit_the_cache_cap_are_unpinned_on_return() {
    let gpu = require_gpu!();
    let _serial = serial();
    let config = PinnedPoolConfig {
        max_cached_bytes: 32 * MIB,
        ..PinnedPoolConfig::default()
    };
    let pool = PinnedPool::with_config(&gpu.context, config);
    let blocks: Vec<_> = (0..3).map(|_| pool.get(16 * MIB).unwrap()).collect();
    let last_address = address(&blocks[2]);
    drop(blocks);
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!(
        (stats.cached_bytes, stats.pinned_bytes),
        (32 * MIB, 32 * MIB)
    );
    assert_eq!((stats.peak_pinned_bytes, stats.frees), (48 * MIB, 1));
    assert!(
        !driver_knows_pinned(last_address),
        "the block past the cap was unpinned"
    );

    let again: Vec<_> = (0..3).map(|_| pool.get(16 * MIB).unwrap()).collect();
    let stats = pool.stats();
    assert_eq!((stats.hits, stats.misses), (2, 4));
    drop(again);
}

#[test]
fn dropping_the_pool_waits_for_pending_blocks_and_unpins_everything() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (kernels, stream) = warmed_up(&gpu.context);
    let pool = PinnedPool::new(&gpu.context);
    let mut busy = pool.get(4 * MIB).unwrap();
    let busy_address = address(&busy);
    let outliving = pool.get(8 * MIB).unwrap();
    let outliving_address = address(&outliving);
    kernels.spin_ns(&stream, SPIN_NS).unwrap();
    busy.record(&stream).unwrap();
    drop(busy);

    // The block keeps the pool's state alive after its handle is gone, and stays usable.
    drop(pool);
    assert!(driver_knows_pinned(busy_address));
    assert!(
        !stream.query().unwrap(),
        "the kernel ended too early to prove anything"
    );
    assert_eq!(outliving.as_slice().len(), 8 * MIB);

    // The last block's return drops the pool state, which waits for the kernel before unpinning.
    drop(outliving);
    assert!(
        stream.query().unwrap(),
        "unpinned before the recorded stream passed"
    );
    assert!(!driver_knows_pinned(busy_address));
    assert!(!driver_knows_pinned(outliving_address));
}

/// A small xorshift generator: deterministic per thread, no dependency.
struct XorShift(u64);

impl XorShift {
    fn below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % bound
    }
}

/// Indices of the first and last 64 bytes of a block of `len` bytes: where a thread stamps it.
fn ends(len: usize) -> impl Iterator<Item = usize> {
    let edge = len.min(64);
    (0..edge).chain(len - edge..len)
}

/// Writes `tag` over the ends of `bytes`.
fn stamp(bytes: &mut [u8], tag: u64) {
    for i in ends(bytes.len()) {
        bytes[i] = tag.to_le_bytes()[i % 8];
    }
}

/// Whether the ends of `bytes` still hold `tag`.
fn stamped(bytes: &[u8], tag: u64) -> bool {
    ends(bytes.len()).all(|i| bytes[i] == tag.to_le_bytes()[i % 8])
}

#[test]
fn eight_threads_share_the_pool_without_losing_or_sharing_a_block() {
    let gpu = require_gpu!();
    let _serial = serial();
    let (kernels, _) = warmed_up(&gpu.context);
    const THREADS: u64 = 8;
    const ITERATIONS: u64 = 250;
    let config = PinnedPoolConfig {
        max_cached_bytes: 64 * MIB,
        ..PinnedPoolConfig::default()
    };
    let pool = PinnedPool::with_config(&gpu.context, config);

    std::thread::scope(|scope| {
        for thread in 0..THREADS {
            let pool = pool.clone();
            let (kernels, context) = (&kernels, &gpu.context);
            scope.spawn(move || {
                let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
                let mut rng = XorShift(0x2545_F491_4F6C_DD1D ^ ((thread + 1) * 0x9E37_79B9));
                let mut held: Vec<(PinnedBlock, u64)> = Vec::new();
                for iteration in 0..ITERATIONS {
                    // Sizes from 1 byte to 8 MiB, spread over the classes, most not powers of two.
                    let scale = 1u64 << rng.below(23);
                    let bytes = (scale + rng.below(scale)) as usize;
                    let mut block = pool.get(bytes).unwrap();
                    assert_eq!(block.len(), bytes);
                    let tag = (thread << 32) | iteration;
                    stamp(block.as_mut_slice(), tag);
                    if rng.below(4) == 0 {
                        kernels.spin_ns(&stream, 20_000).unwrap();
                        block.record(&stream).unwrap();
                    }
                    held.push((block, tag));
                    if held.len() > 4 || rng.below(2) == 0 {
                        let (block, tag) = held.swap_remove(rng.below(held.len() as u64) as usize);
                        assert!(
                            stamped(block.as_slice(), tag),
                            "another thread wrote the block"
                        );
                    }
                }
                for (block, tag) in held {
                    assert!(
                        stamped(block.as_slice(), tag),
                        "another thread wrote the block"
                    );
                }
                stream.synchronize().unwrap();
            });
        }
    });

    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!(stats.gets, THREADS * ITERATIONS);
    assert_eq!(stats.returns, stats.gets);
    assert_eq!((stats.allocated_bytes, stats.allocated_blocks), (0, 0));
    assert!(
        stats.hits > 0,
        "eight threads of traffic never reused a block: {stats:?}"
    );
    assert!(stats.ready_bytes() <= 64 * MIB, "{stats:?}");
    assert_eq!(stats.pinned_bytes, stats.cached_bytes);

    // Every stream was synchronized, so trim can free everything the pool still holds.
    assert_eq!(pool.trim(), stats.cached_bytes);
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!((stats.pinned_bytes, stats.pending_blocks), (0, 0));
    assert_eq!(
        stats.frees, stats.misses,
        "every pinned block was unpinned exactly once"
    );
}

#[test]
fn typed_buffers_from_the_pool_stage_copies_and_go_back_behind_them() {
    use cuweave_memory::{Buffer, DeviceBuffer};
    let _serial = serial();
    let gpu = require_gpu!();
    let (kernels, s) = warmed_up(&gpu.context);
    let pool = PinnedPool::new(&gpu.context);
    let mut staging = pool.buffer::<u32>(1024).expect("pool buffer");
    staging.as_mut_slice().expect("host slice").fill(5);
    let mut device = DeviceBuffer::<u32>::new_on(&s, 1024).expect("device");
    // The stream is busy: the upload queues behind a 100 ms kernel.
    kernels.spin_ns(&s, 100_000_000).expect("spin");
    device
        .copy_from_host_async(&staging, &s)
        .expect("upload from a pool buffer")
        .wait()
        .expect("wait");
    assert_eq!(device.to_vec().expect("read back"), vec![5; 1024]);
    drop(staging);
    // Dropping a pool buffer with queued device work does not wait; its block stays pending.
    kernels.spin_ns(&s, 100_000_000).expect("spin");
    let mut second = pool.buffer::<u32>(1024).expect("second");
    second
        .fill_async(6, &s)
        .expect("a fill queued behind the spin");
    let began = std::time::Instant::now();
    drop(second);
    let took = began.elapsed();
    assert!(
        took < std::time::Duration::from_millis(50),
        "drop took {took:?}"
    );
    assert!(!s.query().expect("query"), "the fill is still queued");
    assert!(pool.stats().pending_blocks >= 1, "{:?}", pool.stats());
    s.synchronize().expect("sync");
}

#[test]
fn cold_blocks_rotate_through_the_pool_and_carry_downloads_byte_for_byte() {
    // A download loop: each block is written by the device, read by the host, given back. The
    // warm `get` would hand the just-read block straight back; `get_cold` grows a rotation (a
    // pin at a time, between which it hands out the oldest block) and, once it is full, reuses
    // a block only after all the rotation's others, and pins nothing more.
    let gpu = require_gpu!();
    let _serial = serial();
    let pool = PinnedPool::new(&gpu.context);
    const BYTES: usize = 64 * KIB;
    let rotation = (PinnedPool::COLD_ROTATION_BYTES / BYTES).min(PinnedPool::COLD_ROTATION_BLOCKS);
    let device = DeviceAllocation::new(&gpu.context, BYTES).unwrap();
    let mut last_seen: std::collections::HashMap<usize, usize> = Default::default();
    let started = std::time::Instant::now();
    let mut full_since = None;
    let mut round = 0;
    while full_since.is_none_or(|full: usize| round < full + 10 * rotation) {
        assert!(
            started.elapsed() < std::time::Duration::from_secs(20),
            "the rotation filled: {:?}",
            pool.stats()
        );
        let value = (round as u32).wrapping_mul(0x9E37_79B9) | 1;
        // SAFETY: `device` holds BYTES bytes, BYTES / 4 words.
        unsafe { memory::memset_d32(&gpu.context, device.ptr(), value, BYTES / 4) }.unwrap();
        let mut block = pool.get_typed_cold::<u32>(BYTES / 4).unwrap();
        block.as_mut_slice().fill(0);
        // SAFETY: `block` holds BYTES bytes and is exclusively borrowed; the copy is blocking.
        unsafe {
            memory::copy_dtoh(
                &gpu.context,
                block.as_mut_slice().as_mut_ptr().cast(),
                device.ptr(),
                BYTES,
            )
        }
        .unwrap();
        assert!(
            block.as_slice().iter().all(|&word| word == value),
            "round {round}: the download landed whole"
        );
        let at = block.as_slice().as_ptr() as usize;
        let before = last_seen.insert(at, round);
        if let (Some(full), Some(before)) = (full_since, before)
            && before > full
        {
            assert!(
                round - before > rotation,
                "round {round}: block reused after {} rounds, within the rotation of {rotation}",
                round - before
            );
        }
        drop(block);
        // One block in use at a time: the full rotation is `rotation + 1` ready blocks and the
        // one out.
        if full_since.is_none() && pool.stats().misses as usize == rotation + 1 {
            full_since = Some(round);
        }
        round += 1;
    }
    let stats = pool.stats();
    assert_balanced(&stats);
    assert_eq!(
        stats.misses as usize,
        rotation + 1,
        "nothing pinned once full: {stats:?}"
    );
    assert_eq!(stats.pinned_bytes, (rotation + 1) * BYTES, "{stats:?}");
    assert_eq!(
        pool.trim(),
        (rotation + 1) * BYTES,
        "trim unpins the rotation"
    );
}

// A data loader pins each batch (`PinnedBuffer::from_slice`, PyTorch's `pin_memory`), uploads
// it, and drops it, while a long kernel of another request runs: the drop must not wait for
// that kernel (`cuMemFreeHost` would, holding the driver's lock so that the next launch waits
// too). The buffers come from the context's default pool, whose blocks are reused.
#[test]
fn temporary_pinned_buffers_never_wait_for_an_unrelated_kernel_and_reuse_the_default_pool() {
    use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer};
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let (kernels, mine) = warmed_up(context);
    let busy = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();
    let mut device = DeviceBuffer::<u32>::zeroed(context, 16 * KIB).unwrap();
    let pool = PinnedPool::default_for(context);
    // One batch first, so the loop below finds its size class cached.
    drop(PinnedBuffer::<u32>::new(context, 16 * KIB).unwrap());
    let hits_before = pool.stats().hits;
    kernels.spin_ns(&busy, 400 * MS).unwrap();
    let started = std::time::Instant::now();
    for batch in 0..64u32 {
        let data: Vec<u32> = (0..16 * KIB as u32).map(|i| i ^ batch).collect();
        let pinned = PinnedBuffer::from_slice(context, &data).unwrap();
        let pinned = device
            .copy_from_host_async(pinned, &mine)
            .unwrap()
            .wait()
            .unwrap();
        drop(pinned);
        kernels.spin_ns(&mine, 0).unwrap();
        if batch % 16 == 0 {
            assert_eq!(device.to_vec().unwrap(), data, "batch {batch}");
        }
    }
    let took = started.elapsed();
    assert!(
        !busy.query().unwrap(),
        "the unrelated kernel ended first: the loop took {took:?}"
    );
    assert!(
        took < std::time::Duration::from_millis(300),
        "64 batches took {took:?}"
    );
    assert!(pool.stats().hits >= hits_before + 64, "{:?}", pool.stats());
    busy.synchronize().unwrap();
    // A fresh buffer is zeroed whatever its block last held.
    let fresh = PinnedBuffer::<u32>::new(context, 16 * KIB).unwrap();
    assert!(fresh.as_slice().unwrap().iter().all(|&x| x == 0));
}

// A context borrowed from another library may be destroyed by it: `PinnedBuffer::new` on it
// pins memory of the buffer's own, and no process-wide pool keeps it.
#[test]
fn pinned_buffers_of_a_borrowed_context_stay_out_of_the_default_pool() {
    use cuweave_memory::buffer::PinnedBuffer;
    let gpu = require_gpu!();
    let _serial = serial();
    // SAFETY: the primary context `gpu.context` retains outlives the borrowed handle.
    let borrowed =
        unsafe { Context::from_raw_borrowed(gpu.context.as_raw(), gpu.context.device()) };
    assert!(borrowed.is_borrowed());
    let shared = PinnedPool::default_for(&gpu.context);
    let gets = shared.stats().gets;
    let buffer = PinnedBuffer::<u32>::new(&borrowed, 4 * KIB).unwrap();
    assert!(buffer.as_slice().unwrap().iter().all(|&x| x == 0));
    drop(buffer);
    assert_eq!(
        shared.stats().gets,
        gets,
        "the borrowed context used the shared pool"
    );
    let own = PinnedPool::default_for(&borrowed);
    assert_eq!(
        own.stats().gets,
        0,
        "a borrowed context's pool is not shared"
    );
}
