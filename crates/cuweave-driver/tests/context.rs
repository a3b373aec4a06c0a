//! One primary context shared by many threads, and peer access between devices.

use std::sync::{Arc, Barrier};

use cuweave_driver::memory::{self, DeviceAllocation};
use cuweave_driver::{Context, Device, DriverError, Stream, StreamFlags, driver, sys};
use cuweave_test_support::require_gpu;

const THREADS: u32 = 8;

/// The calling thread's current context, straight from the driver.
fn current_context() -> sys::CUcontext {
    let api = driver().unwrap();
    let get_current = api.ctx_get_current.get().unwrap();
    let mut current = std::ptr::null_mut();
    // SAFETY: `current` is a valid out-pointer for the duration of the call.
    let status = unsafe { get_current(&mut current) };
    assert_eq!(status, sys::CUresult::CUDA_SUCCESS);
    current
}

#[test]
fn eight_threads_share_one_context_each_with_its_own_buffer() {
    let gpu = require_gpu!();
    // All threads issue their driver calls at once, so they really overlap.
    let start = Arc::new(Barrier::new(THREADS as usize));
    let workers: Vec<_> = (0..THREADS)
        .map(|thread| {
            let context = Arc::clone(&gpu.context);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                // A fresh OS thread has no current context: whatever works below, the safe
                // handles made current themselves.
                assert!(current_context().is_null());
                start.wait();
                // Different lengths per thread, so a mix-up of buffers shows as a length error too.
                let words = (1 << 18) + 7 * thread as usize;
                let buffer = DeviceAllocation::new(&context, words * 4).unwrap();
                assert_eq!(current_context(), context.as_raw());
                let pattern = 0xA5A5_0000 | thread;
                let mut host = vec![0u32; words];
                // SAFETY: `buffer` holds `words` 4-byte-aligned u32s and `host` is writable for
                // the same byte count; both are synchronous calls on the legacy stream, so the
                // copy sees the memset.
                unsafe {
                    memory::memset_d32(&context, buffer.ptr(), pattern, words).unwrap();
                    memory::copy_dtoh(&context, host.as_mut_ptr().cast(), buffer.ptr(), words * 4)
                        .unwrap();
                }
                if let Some(bad) = host.iter().position(|&word| word != pattern) {
                    panic!(
                        "thread {thread}: word {bad} is {:#x}, not {pattern:#x}",
                        host[bad]
                    );
                }
                context.bind_to_thread().unwrap();
                assert_eq!(current_context(), context.as_raw());
            })
        })
        .collect();
    for worker in workers {
        worker.join().expect("a worker thread failed");
    }
    // Every clone went back: only the test's own handle still holds the context.
    assert_eq!(Arc::strong_count(&gpu.context), 1);
}

#[test]
fn peer_access_is_queryable_between_every_pair_and_enabling_is_idempotent() {
    let gpu = require_gpu!();
    // A device is never its own peer, whatever the machine.
    assert!(!gpu.device.can_access_peer(&gpu.device).unwrap());
    match gpu.context.enable_peer_access(&gpu.context) {
        Err(DriverError::InvalidArgument { operation, .. }) => {
            assert_eq!(operation, "Context::enable_peer_access");
        }
        other => panic!("peer access to itself gave {other:?}"),
    }

    let devices = Device::all().unwrap();
    if devices.len() < 2 {
        eprintln!("one device: no pairs to enable peer access between");
        return;
    }
    for a in &devices {
        for b in devices.iter().filter(|b| *b != a) {
            let forward = a.can_access_peer(b).unwrap();
            let backward = b.can_access_peer(a).unwrap();
            eprintln!(
                "peer access {} -> {}: {forward}, back: {backward}",
                a.ordinal(),
                b.ordinal()
            );
            if !forward {
                continue;
            }
            let (ca, cb) = (Context::primary(*a).unwrap(), Context::primary(*b).unwrap());
            ca.enable_peer_access(&cb).unwrap();
            ca.enable_peer_access(&cb)
                .expect("enabling peer access a second time is not an error");
            copy_between(&ca, &cb);
        }
    }
}

/// Copies a pattern from `from`'s device to `to`'s device and back, checking it arrived.
fn copy_between(from: &Arc<Context>, to: &Arc<Context>) {
    const WORDS: usize = 1 << 16;
    let bytes = WORDS * 4;
    let source = DeviceAllocation::new(from, bytes).unwrap();
    let target = DeviceAllocation::new(to, bytes).unwrap();
    let stream = Stream::new(from, StreamFlags::NON_BLOCKING).unwrap();
    let pattern = 0x5EE5_0000 | from.device().ordinal() as u32;
    let mut host = vec![0u32; WORDS];
    // SAFETY: both allocations hold `bytes` bytes and outlive the synchronize; the memset and
    // the peer copy are ordered on `stream`, and `host` is written only by the copy after it.
    unsafe {
        memory::memset_d32_async(source.ptr(), pattern, WORDS, &stream).unwrap();
        memory::copy_peer_async(target.ptr(), to, source.ptr(), from, bytes, &stream).unwrap();
        stream.synchronize().unwrap();
        memory::copy_dtoh(to, host.as_mut_ptr().cast(), target.ptr(), bytes).unwrap();
    }
    assert!(host.iter().all(|&word| word == pattern));
}

/// Sets the calling thread's current context straight through the driver.
fn set_current(context: sys::CUcontext) {
    let api = driver().unwrap();
    let set_current = api.ctx_set_current.get().unwrap();
    // SAFETY: `context` is null (none) or a live context retained by the test.
    let status = unsafe { set_current(context) };
    assert_eq!(status, sys::CUresult::CUDA_SUCCESS);
}

#[test]
fn a_scoped_current_context_restores_the_previous_one_including_none() {
    let gpu = require_gpu!();
    let context = Arc::clone(&gpu.context);
    // A fresh thread: no context is current before, inside the guard it is ours, and after it
    // none is current again, even though cuweave calls inside bound it again.
    std::thread::spawn(move || {
        assert!(current_context().is_null());
        {
            let guard = context.make_current_scoped().unwrap();
            assert!(guard.previous_raw().is_null());
            assert_eq!(current_context(), context.as_raw());
            let buffer = DeviceAllocation::new(&context, 4096).unwrap();
            drop(buffer);
        }
        assert!(current_context().is_null());
        // bind_to_thread, by contrast, leaves the context current.
        context.bind_to_thread().unwrap();
        assert_eq!(current_context(), context.as_raw());
        // Nested guards restore in scope order; the outer one puts "none" back.
        set_current(std::ptr::null_mut());
        {
            let _outer = context.make_current_scoped().unwrap();
            set_current(std::ptr::null_mut());
            {
                let inner = context.make_current_scoped().unwrap();
                assert!(inner.previous_raw().is_null());
                assert_eq!(current_context(), context.as_raw());
            }
            assert!(current_context().is_null());
        }
        assert!(current_context().is_null());
    })
    .join()
    .unwrap();
    // With a second device, a guard for it restores the first device's context.
    let Ok(other) = Device::get(1) else { return };
    let other = Context::primary(other).unwrap();
    gpu.context.bind_to_thread().unwrap();
    {
        let guard = other.make_current_scoped().unwrap();
        assert_eq!(guard.previous_raw(), gpu.context.as_raw());
        assert_eq!(current_context(), other.as_raw());
    }
    assert_eq!(current_context(), gpu.context.as_raw());
}

#[test]
fn queries_poll_without_changing_the_threads_current_context() {
    let gpu = require_gpu!();
    let context = Arc::clone(&gpu.context);
    let stream = Stream::new(&context, StreamFlags::NON_BLOCKING).unwrap();
    let event =
        cuweave_driver::Event::new(&context, cuweave_driver::EventFlags::DISABLE_TIMING).unwrap();
    event.record(&stream).unwrap();
    stream.synchronize().unwrap();
    // A thread with no current context: the fast path answers without binding one.
    std::thread::scope(|scope| {
        scope.spawn(|| {
            assert!(current_context().is_null());
            assert_eq!(event.query(), Ok(true));
            assert_eq!(stream.query(), Ok(true));
            eprintln!(
                "current context after polling with none current: {:?}",
                current_context()
            );
        });
    });
}
