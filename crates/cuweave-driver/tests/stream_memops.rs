//! Stream memory operations, unified-addressing copies and peer attributes on a real GPU.
//!
//! The stream writes and waits are observed through mapped pinned host memory: the host sees a
//! word change only when the GPU has passed the work before it, and a stream gated on a word
//! runs nothing behind the gate until the host writes it.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuweave_driver::memory::{self, DeviceAllocation, HostAllocFlags, HostAllocation};
use cuweave_driver::sys::CUdevice_P2PAttribute;
use cuweave_driver::{Device, DriverError, Stream, StreamFlags, WaitCondition, WriteOrdering};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

const MS: u64 = 1_000_000;

/// A mapped pinned page whose first words the host reads and writes atomically.
fn mapped_words(context: &std::sync::Arc<cuweave_driver::Context>) -> HostAllocation {
    let mut page = HostAllocation::new(context, 4096, HostAllocFlags::PORTABLE_MAPPED).unwrap();
    page.as_bytes_mut().fill(0);
    page
}

fn word32(page: &HostAllocation) -> &AtomicU32 {
    // SAFETY: the page is 4096 bytes of page-aligned pinned memory that lives as long as the
    // borrow; the device touches it only through 32-bit stream memory operations, and the host
    // only through this atomic.
    unsafe { &*page.as_ptr().cast::<AtomicU32>() }
}

fn word64(page: &HostAllocation) -> &AtomicU64 {
    // SAFETY: as `word32`, at offset 8 (8-byte aligned), touched only as a 64-bit word.
    unsafe { &*page.as_ptr().add(8).cast::<AtomicU64>() }
}

#[test]
fn a_stream_write_lands_in_mapped_memory_only_after_the_work_before_it() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let page = mapped_words(&gpu.context);
    let base = page.device_ptr().unwrap();

    kernels.spin_ns(&stream, 30 * MS).unwrap();
    // SAFETY: `base` and `base + 8` are aligned words of the mapped page, alive until the
    // stream is synchronized below; the host reads them only atomically.
    unsafe {
        stream
            .write_value_u32(base, 7, WriteOrdering::AfterPriorWrites)
            .unwrap();
        stream
            .write_value_u64(base + 8, 0x1_0000_0002, WriteOrdering::AfterPriorWrites)
            .unwrap();
    }
    let queued = Instant::now();
    assert_eq!(
        word32(&page).load(Ordering::Acquire),
        0,
        "write overtook the spin"
    );
    // The host sees the words change without synchronizing: poll them.
    while word64(&page).load(Ordering::Acquire) != 0x1_0000_0002 {
        assert!(
            queued.elapsed() < Duration::from_secs(5),
            "the write never landed"
        );
        std::hint::spin_loop();
    }
    assert!(
        queued.elapsed() >= Duration::from_millis(20),
        "the words changed after {:?}, before the 30 ms spin could end",
        queued.elapsed()
    );
    assert_eq!(word32(&page).load(Ordering::Acquire), 7);
    stream.synchronize().unwrap();
}

#[test]
fn a_stream_waiting_on_a_word_runs_nothing_behind_it_until_the_host_writes_it() {
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let page = mapped_words(&gpu.context);
    let gate = page.device_ptr().unwrap();
    let out = DeviceAllocation::new(&gpu.context, 4 * 1024).unwrap();

    // SAFETY: the gate word lives until the stream is synchronized; `out` holds 1024 words and
    // outlives the kernel (dropped after the synchronize).
    unsafe {
        stream
            .wait_value_u32(gate, 1, WaitCondition::AtLeast)
            .unwrap();
        kernels
            .fill_u32(&stream, out.ptr(), 0xC0FFEE, 1024)
            .unwrap();
    }
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !stream.query().unwrap(),
        "the stream ran past an unopened gate"
    );
    word32(&page).store(1, Ordering::Release);
    stream.synchronize().unwrap();

    let mut host = vec![0u8; 4 * 1024];
    // SAFETY: `host` and `out` are both 4 KiB.
    unsafe { memory::copy_dtoh(&gpu.context, host.as_mut_ptr(), out.ptr(), host.len()) }.unwrap();
    let words: Vec<u32> = host
        .chunks_exact(4)
        .map(|chunk| u32::from_ne_bytes(chunk.try_into().unwrap()))
        .collect();
    assert!(words.iter().all(|&word| word == 0xC0FFEE));
}

#[test]
fn unified_addressing_copies_round_trip_host_device_and_pinned_bytes() {
    let gpu = require_gpu!();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let bytes = (1 << 20) + 3;
    let source: Vec<u8> = (0..bytes).map(|i| (i * 31 % 251) as u8).collect();
    let device = DeviceAllocation::new(&gpu.context, bytes).unwrap();
    let mut pinned = HostAllocation::new(&gpu.context, bytes, HostAllocFlags::default()).unwrap();

    // SAFETY: `source` (pageable host) and `device` are both `bytes` long; cuMemcpy infers the
    // host side from the address under unified addressing.
    unsafe { memory::copy(&gpu.context, device.ptr(), source.as_ptr() as u64, bytes) }.unwrap();
    // SAFETY: `pinned` and `device` are `bytes` long and untouched by the host until the
    // stream is synchronized.
    unsafe { memory::copy_async(pinned.as_mut_ptr() as u64, device.ptr(), bytes, &stream) }
        .unwrap();
    stream.synchronize().unwrap();
    assert!(pinned.as_bytes() == source.as_slice());
}

#[test]
fn peer_attributes_agree_with_peer_access_and_refuse_a_device_paired_with_itself() {
    let gpu = require_gpu!();
    match gpu.device.p2p_attribute(
        &gpu.device,
        CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED,
    ) {
        Err(DriverError::InvalidArgument { operation, .. }) => {
            assert_eq!(operation, "Device::p2p_attribute");
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    assert_eq!(gpu.device.peer_link(&gpu.device).unwrap(), None);
    let devices = Device::all().unwrap();
    for a in &devices {
        for b in devices.iter().filter(|b| *b != a) {
            let link = a.peer_link(b).unwrap();
            assert_eq!(
                link.is_some(),
                a.can_access_peer(b).unwrap(),
                "{a:?} -> {b:?}"
            );
            if let Some(link) = link {
                assert!(link.performance_rank >= 0);
            }
        }
    }
}

/// Reads the `u32` at `ptr` (device memory) with a blocking copy.
fn read_flag(context: &std::sync::Arc<cuweave_driver::Context>, ptr: memory::DevicePtr) -> u32 {
    let mut value = [0u8; 4];
    // SAFETY: `ptr` is a live 4-byte device allocation; `value` is writable for 4 bytes.
    unsafe { memory::copy_dtoh(context, value.as_mut_ptr(), ptr, 4) }.unwrap();
    u32::from_ne_bytes(value)
}

#[test]
fn completion_words_return_only_after_the_work_before_them_by_word_or_by_fallback() {
    use cuweave_driver::memory::CompletionWords;
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    // A budget long enough that the word answers, and none at all (straight to the fallback).
    for spin in [Duration::from_secs(2), Duration::ZERO] {
        let words = CompletionWords::with_spin(&gpu.context, spin).unwrap();
        let streams: Vec<Stream> = (0..4)
            .map(|_| Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap())
            .collect();
        let flags = DeviceAllocation::new(&gpu.context, 4 * 4).unwrap();
        // SAFETY: `flags` is a live, aligned 16-byte allocation.
        unsafe { memory::memset_d32(&gpu.context, flags.ptr(), 0, 4) }.unwrap();
        // Four threads share the page (and so, at times, a word), each waiting on its own
        // stream behind a spin of a different length that ends by setting its flag.
        std::thread::scope(|scope| {
            for (i, stream) in streams.iter().enumerate() {
                let (kernels, words, flag) = (&kernels, &words, flags.ptr() + 4 * i as u64);
                let context = &gpu.context;
                scope.spawn(move || {
                    for round in 1..=3u32 {
                        let started = Instant::now();
                        // SAFETY: `flag` is a live 4-byte word of `flags`, which outlives the
                        // stream's work (waited for below).
                        unsafe {
                            kernels
                                .spin_then_store_u32(stream, (5 + 5 * i as u64) * MS, flag, round)
                                .unwrap()
                        };
                        words.synchronize(stream).unwrap();
                        assert_eq!(
                            read_flag(context, flag),
                            round,
                            "returned before the spin kernel on stream {i} ended (spin budget {spin:?})"
                        );
                        assert!(started.elapsed() >= Duration::from_millis(4));
                    }
                });
            }
        });
        // Back-to-back short waits: each returns after its own write.
        for _ in 0..100 {
            words.synchronize(&streams[0]).unwrap();
        }
    }
}

/// Waits (bounded) until the retirement thread has retired every dropped, written word; whether
/// it did within `limit`.
fn until_retired(limit: Duration) -> bool {
    cuweave_test_support::poll_until(limit, || memory::host_allocations_awaiting_free() == 0)
}

#[test]
fn dropped_mapped_words_are_freed_only_after_the_writes_queued_into_them_and_the_drop_waits_for_none()
 {
    use cuweave_driver::memory::MappedWords;
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    assert!(
        until_retired(Duration::from_secs(10)),
        "words of earlier tests still wait"
    );
    for round in 0..3u64 {
        let words = MappedWords::new(&gpu.context, 512).unwrap();
        // The write lands only after a 200 ms spin; the words are dropped long before that.
        kernels.spin_ns(&stream, 200 * MS).unwrap();
        words.enqueue_write(&stream, 511, round + 1).unwrap();
        assert_ne!(words.load(511), Some(round + 1));
        let dropping = Instant::now();
        drop(words);
        assert!(
            dropping.elapsed() < Duration::from_millis(100),
            "round {round}: the drop waited {:?} for the queued write",
            dropping.elapsed()
        );
        // Not freed under the queued write: it waits for the stream, and goes once it passed.
        assert_eq!(
            stream.query(),
            Ok(false),
            "round {round}: the spin ended already"
        );
        assert!(
            memory::host_allocations_awaiting_free() >= 1,
            "round {round}"
        );
        assert!(
            until_retired(Duration::from_secs(10)),
            "round {round}: never freed"
        );
        assert_eq!(
            stream.query(),
            Ok(true),
            "round {round}: freed before the write landed"
        );
    }
    // Many written and dropped words: each is freed, nothing waits for ever.
    for value in 1..=2000u64 {
        let words = MappedWords::new(&gpu.context, 1).unwrap();
        words.enqueue_write(&stream, 0, value).unwrap();
        drop(words);
    }
    assert!(
        until_retired(Duration::from_secs(10)),
        "{} dropped words still wait 10 s later",
        memory::host_allocations_awaiting_free()
    );
}

#[test]
fn written_mapped_words_dropped_during_a_capture_are_freed_once_it_ends() {
    use cuweave_driver::CaptureMode;
    use cuweave_driver::memory::MappedWords;
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let writer = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let capturing = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&capturing, 0).unwrap();
    capturing.synchronize().unwrap();
    assert!(
        until_retired(Duration::from_secs(10)),
        "words of earlier tests still wait"
    );
    let words = MappedWords::new(&gpu.context, 1).unwrap();
    words.enqueue_write(&writer, 0, 1).unwrap();
    writer.synchronize().unwrap();
    capturing.begin_capture(CaptureMode::Global).unwrap();
    kernels.spin_ns(&capturing, MS).unwrap();
    // Dropped on a capturing thread: the drop neither breaks the capture nor frees under it;
    // the wait for the context is refused while the capture runs, and retried.
    drop(words);
    std::thread::sleep(Duration::from_millis(30));
    assert_eq!(
        memory::host_allocations_awaiting_free(),
        1,
        "freed while a capture was active"
    );
    let graph = capturing
        .end_capture()
        .expect("the capture survived the drop");
    assert!(
        until_retired(Duration::from_secs(10)),
        "never freed after the capture"
    );
    // The recorded spin still replays.
    let exec = graph.instantiate(&Default::default()).unwrap();
    exec.launch(&capturing).unwrap();
    capturing.synchronize().unwrap();
}

#[test]
fn dropping_written_mapped_words_never_waits_for_a_long_kernel_on_another_stream() {
    use cuweave_driver::memory::MappedWords;
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let writer = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let busy = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&writer, 0).unwrap();
    writer.synchronize().unwrap();
    // No kept pages of earlier tests: the page reused below can only be this test's.
    cuweave_driver::empty_process_caches();
    let words = MappedWords::new(&gpu.context, 8).unwrap();
    words.enqueue_write(&writer, 3, 7).unwrap();
    writer.synchronize().unwrap();
    assert_eq!(words.load(3), Some(7));
    // An unrelated 400 ms kernel: the words' own write has landed, so nothing of theirs waits.
    let spin_started = Instant::now();
    kernels.spin_ns(&busy, 400 * MS).unwrap();
    let address = words.device_address(3).unwrap();
    let dropping = Instant::now();
    drop(words);
    assert!(
        dropping.elapsed() < Duration::from_millis(50),
        "dropping mapped words waited {:?} for an unrelated kernel",
        dropping.elapsed()
    );
    // Their retirement waits for the context on a thread of its own and holds up no one:
    // a launch on a third stream goes at once.
    std::thread::sleep(Duration::from_millis(5));
    assert!(memory::host_allocations_awaiting_free() >= 1);
    let third = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let launching = Instant::now();
    kernels.spin_ns(&third, 0).unwrap();
    assert!(
        launching.elapsed() < Duration::from_millis(50),
        "a launch waited {:?} behind the words' retirement",
        launching.elapsed()
    );
    // They are retired once the context is idle: after the unrelated kernel, not before.
    assert!(until_retired(Duration::from_secs(10)), "never retired");
    assert_eq!(busy.query(), Ok(true));
    assert!(spin_started.elapsed() >= Duration::from_millis(300));
    // The page is kept, not freed (a free would wait for the whole device): the next words of
    // that size take it again, zeroed.
    let again = MappedWords::new(&gpu.context, 8).unwrap();
    assert_eq!(
        again.device_address(3),
        Some(address),
        "the retired page was not reused"
    );
    assert_eq!(again.load(3), Some(0));
}

#[test]
fn stream_marks_are_reached_in_order_only_after_the_work_before_them() {
    use cuweave_driver::memory::{MappedWords, StreamMarks};
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let stream = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let other = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let words = std::sync::Arc::new(MappedWords::new(&gpu.context, 4).unwrap());
    let marks = StreamMarks::new(words.clone(), 3, &stream, 0).unwrap();

    // Three spins of 10, 20 and 30 ms, a mark behind each: each mark is reached only once its
    // spin has run, and a later one never before an earlier one.
    let started = Instant::now();
    let mut queued = Vec::new();
    for step in 1..=3u64 {
        kernels.spin_ns(&stream, 10 * step * MS).unwrap();
        queued.push(marks.mark(&stream).unwrap());
    }
    assert!(queued.windows(2).all(|pair| pair[0] < pair[1]));
    assert!(!marks.is_reached(queued[0]), "a mark overtook its spin");
    for (step, mark) in queued.iter().enumerate() {
        marks.wait(*mark, &stream).unwrap();
        let floor = Duration::from_millis(10 * [1, 3, 6][step] - 2);
        assert!(
            started.elapsed() >= floor,
            "mark {step} reached after {:?}, before its spins could end",
            started.elapsed()
        );
        // The next mark waits behind a spin of at least 20 ms more.
        if let Some(later) = queued.get(step + 1) {
            assert!(
                !marks.is_reached(*later),
                "mark {} overtook its spin",
                step + 1
            );
        }
    }

    // Another stream is refused, for marking and for waiting.
    assert!(matches!(
        marks.mark(&other),
        Err(DriverError::InvalidArgument { .. })
    ));
    assert!(matches!(
        marks.wait(queued[0], &other),
        Err(DriverError::InvalidArgument { .. })
    ));
    assert!(matches!(
        StreamMarks::new(words.clone(), 4, &stream, 0),
        Err(DriverError::InvalidArgument { .. })
    ));

    // The word is the marks' alone: second marks on it, a host store and another stream's
    // queued write are refused, and the word keeps what the marks wrote.
    assert!(matches!(
        StreamMarks::new(words.clone(), 3, &other, 0),
        Err(DriverError::InvalidArgument { .. })
    ));
    assert!(!words.store(3, u64::MAX));
    assert!(matches!(
        words.enqueue_write(&other, 3, u64::MAX),
        Err(DriverError::InvalidArgument { .. })
    ));
    other.synchronize().unwrap();
    assert_eq!(words.load(3), Some(3));
    assert!(words.store(2, 9), "a word no marks hold takes host stores");

    // The word handed on, even with a stale last number: the next owner's marks start above
    // everything queued into it, so a mark of the new owner is never reached by what the old
    // one wrote.
    let (words, index, last) = marks.into_parts();
    assert_eq!(last, 3);
    let next = StreamMarks::new(words, index, &other, 0).unwrap();
    kernels.spin_ns(&other, 20 * MS).unwrap();
    let mark = next.mark(&other).unwrap();
    assert_eq!(mark.value(), 4);
    assert!(
        !next.is_reached(mark),
        "the old owner's word reached a new mark"
    );
    next.wait(mark, &other).unwrap();
    assert!(next.is_reached(mark));

    // Thousands of marks in a row: waits that return as each lands, none early.
    let many: Vec<_> = (0..2000).map(|_| next.mark(&other).unwrap()).collect();
    for mark in &many {
        next.wait(*mark, &other).unwrap();
    }
    assert!(many.iter().all(|mark| next.is_reached(*mark)));
    other.synchronize().unwrap();
}

// A program drops waiters (their completion words go to the retirement thread) while its main
// thread captures graphs: the retirement thread's context synchronisation must never land in a
// capture that began after it checked for captures, which would invalidate the capture.
#[test]
fn captures_begun_while_dropped_words_retire_are_never_invalidated() {
    use cuweave_driver::CaptureMode;
    use cuweave_driver::memory::MappedWords;
    let gpu = require_gpu!();
    let _serial = cuweave_test_support::serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let writer = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    let capturing = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    kernels.spin_ns(&capturing, 0).unwrap();
    capturing.synchronize().unwrap();
    for round in 0..200u64 {
        let words = MappedWords::new(&gpu.context, 1).unwrap();
        kernels.spin_ns(&writer, 20_000).unwrap();
        words.enqueue_write(&writer, 0, round + 1).unwrap();
        drop(words);
        capturing.begin_capture(CaptureMode::Global).unwrap();
        kernels.spin_ns(&capturing, 1_000).unwrap();
        let graph = capturing
            .end_capture()
            .unwrap_or_else(|error| panic!("round {round}: the capture broke: {error}"));
        drop(graph);
    }
    assert!(
        until_retired(Duration::from_secs(10)),
        "dropped words never retired"
    );
}

// A handle borrowed from another library (`from_raw(.., owned: false)`) says nothing, by its
// drop, about its stream, which lives on: it is never watched for its end.
#[test]
fn only_a_handle_that_owns_its_stream_can_be_watched_for_its_end() {
    let gpu = require_gpu!();
    let owner = Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).unwrap();
    assert!(owner.owns_its_stream());
    // SAFETY: `owner` outlives the borrowed handle, which does not destroy the stream.
    let borrowed = unsafe { Stream::from_raw(&gpu.context, owner.as_raw(), false) };
    assert!(!borrowed.owns_its_stream());
    assert!(borrowed.end_watch().is_none());
    assert!(Stream::legacy_default(&gpu.context).end_watch().is_none());
    let end = owner.end_watch().expect("an owning handle is watched");
    assert!(!end.is_dropped());
    drop(borrowed);
    drop(owner);
    assert!(end.is_dropped());
    let started = Instant::now();
    while !end.is_finished().unwrap() {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "the end never finished"
        );
        std::thread::yield_now();
    }
}
