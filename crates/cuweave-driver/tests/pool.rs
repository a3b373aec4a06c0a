//! Stream-ordered allocation on a real GPU: private and default pools, their attributes, and
//! memory that is written, read back and handed back to the pool and the driver.

use std::sync::Arc;

use cuweave_driver::memory::{self, DevicePtr, MemoryPool, MemoryType};
use cuweave_driver::{Context, DriverError, Stream, StreamFlags};
use cuweave_test_support::require_gpu;

const MIB: usize = 1 << 20;
const WORDS: usize = MIB / 4;

/// Whether pools work here; where they cannot, proves that creating one says so with a typed error.
fn pools_supported(context: &Arc<Context>) -> bool {
    if context.device().supports_memory_pools().unwrap() {
        return true;
    }
    let refused = MemoryPool::new(context);
    assert!(
        matches!(
            refused,
            Err(DriverError::CapabilityMissing {
                capability: "memory pools",
                ..
            })
        ),
        "{refused:?}"
    );
    false
}

/// Fills 1 MiB at `ptr` with `word` on `stream`, then checks every word of it.
fn fill_and_check(ptr: DevicePtr, word: u32, stream: &Stream) {
    // SAFETY: `ptr` is a live stream-ordered allocation of at least 1 MiB made on `stream`, so a
    // memset queued after the allocation may write it.
    unsafe { memory::memset_d32_async(ptr, word, WORDS, stream) }.unwrap();
    check(ptr, word, stream);
}

/// Copies 1 MiB at `ptr` back on `stream` and checks that every word is `word`.
fn check(ptr: DevicePtr, word: u32, stream: &Stream) {
    let mut host = vec![0u32; WORDS];
    // SAFETY: as `fill_and_check`; `host` holds 1 MiB and is read only after the synchronize.
    unsafe { memory::copy_dtoh_async(host.as_mut_ptr().cast(), ptr, MIB, stream) }.unwrap();
    stream.synchronize().unwrap();
    if let Some(bad) = host.iter().position(|&w| w != word) {
        panic!("word {bad} is {:#x}, not {word:#x}", host[bad]);
    }
}

#[test]
fn a_private_pool_serves_caches_and_returns_memory() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    if !pools_supported(context) {
        return;
    }
    let pool = MemoryPool::new(context).unwrap();
    pool.set_release_threshold(u64::MAX).unwrap();
    assert_eq!(pool.release_threshold().unwrap(), u64::MAX);
    assert_eq!(pool.used_bytes().unwrap(), 0);
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();

    // SAFETY: freed exactly once below, on the same stream, after its last use.
    let ptr = unsafe { pool.alloc_async(MIB, &stream) }.unwrap();
    fill_and_check(ptr, 0xB10C_0001, &stream);
    assert!(pool.used_bytes().unwrap() >= MIB as u64);
    let attributes = memory::pointer_attributes(ptr).unwrap();
    assert_eq!(attributes.memory_type, MemoryType::Device);
    // SAFETY: `ptr` came from this pool and nothing queued after this free uses it.
    unsafe { memory::free_async(ptr, &stream) }.unwrap();
    stream.synchronize().unwrap();

    assert_eq!(pool.used_bytes().unwrap(), 0);
    let reserved = pool.reserved_bytes().unwrap();
    assert!(
        reserved >= MIB as u64,
        "an unlimited release threshold kept only {reserved} bytes after a synchronize"
    );

    // The next allocation is served from what the pool kept, without reserving more.
    // SAFETY: as above.
    let again = unsafe { pool.alloc_async(MIB, &stream) }.unwrap();
    fill_and_check(again, 0xB10C_0002, &stream);
    assert_eq!(pool.reserved_bytes().unwrap(), reserved);
    // SAFETY: as above.
    unsafe { memory::free_async(again, &stream) }.unwrap();
    stream.synchronize().unwrap();

    // With nothing outstanding, trimming to zero hands everything back to the driver.
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0);
}

#[test]
fn the_default_pool_and_plain_alloc_async_serve_the_stream() {
    let gpu = require_gpu!();
    let context = &gpu.context;
    if !pools_supported(context) {
        return;
    }
    let pool = MemoryPool::device_default(context).unwrap();
    let stream = Stream::new(context, StreamFlags::NON_BLOCKING).unwrap();

    // SAFETY: freed exactly once below, on the same stream, after its last use.
    let from_pool = unsafe { pool.alloc_async(MIB, &stream) }.unwrap();
    // SAFETY: as above.
    let plain = unsafe { memory::alloc_async(&stream, MIB) }.unwrap();
    assert_ne!(from_pool, plain);
    fill_and_check(from_pool, 0xDEF0_0001, &stream);
    fill_and_check(plain, 0xDEF0_0002, &stream);
    // Other tests may share the default pool, but our two live megabytes are certainly in it.
    assert!(pool.used_bytes().unwrap() >= 2 * MIB as u64);
    assert!(pool.reserved_bytes().unwrap() >= 2 * MIB as u64);
    // The first fill survived the second: the allocations do not overlap.
    check(from_pool, 0xDEF0_0001, &stream);

    // SAFETY: both came from stream-ordered allocation and nothing after the frees uses them.
    unsafe {
        memory::free_async(from_pool, &stream).unwrap();
        memory::free_async(plain, &stream).unwrap();
    }
    stream.synchronize().unwrap();
}
