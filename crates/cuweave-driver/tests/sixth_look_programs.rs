//! A sixth look at the driver layer, aimed at this session's changes: every call no capture
//! records (allocating, freeing, pinning, pools, module loads and unloads) now always runs in
//! relaxed capture mode; `Context::synchronize` checks and synchronises under the reentrant
//! "no capture begins" read lock; `begin_capture` refuses a `CUstream` that already captures
//! through another handle (an alias, or a stream forked into another capture) before it asks
//! the stream's flags; pool attribute reads and `trim_to` are relaxed too. Each test checks an
//! outcome: captures that end valid and replay exact counts, the thread's own capture mode put
//! back (after failing calls too), typed refusals matched by variant, and liveness of capture
//! begins beside many synchronising threads.

mod common;

use common::{CaptureRounds, non_blocking, pools_supported, read_u32, warmed_kernels};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use cuweave_driver::graph::CaptureModeGuard;
use cuweave_driver::memory::{
    self, DeviceAllocation, HostAllocFlags, HostAllocation, HostRegistration, ManagedAllocation,
    MappedWords, MemoryPool,
};
use cuweave_driver::{
    CaptureMode, Context, DriverError, Event, EventFlags, GraphError, InstantiateOptions, Module,
    Stream,
};
use cuweave_test_support::{poll_until, require_gpu, serial};

/// A kernel-less module, the smallest a JIT accepts: what a user loads and unloads at run time.
const NOOP_PTX: &str = "\
.version 6.0
.target sm_50
.address_size 64

.visible .entry sixth_look_noop()
{
    ret;
}
";

/// This thread's capture mode, read through the public guard (entering relaxed mode hands the
/// previous mode back; the guard's drop puts it back).
fn thread_mode() -> CaptureMode {
    CaptureModeGuard::enter(CaptureMode::Relaxed)
        .expect("cuThreadExchangeStreamCaptureMode")
        .previous()
}

fn managed_supported(context: &Arc<Context>) -> bool {
    context.device().supports_managed_memory().unwrap()
}

/// One round of the calls no capture records, as a data loader or a caching allocator makes
/// them: device, pinned and managed allocations made and freed, a host buffer pinned and
/// unpinned, a private pool made, tuned, read, trimmed and dropped, a module loaded and
/// unloaded. Checks the values it can (pinned bytes round-trip on the host, the pool's threshold
/// reads back).
fn unrecorded_calls(context: &Arc<Context>) -> Result<(), DriverError> {
    drop(DeviceAllocation::new(context, 256 << 10)?);
    let mut pinned = HostAllocation::new(context, 4096, HostAllocFlags::default())?;
    pinned.as_bytes_mut().fill(0xA5);
    assert!(pinned.as_bytes().iter().all(|&b| b == 0xA5));
    drop(pinned);
    let mut host = vec![7u8; 8192];
    {
        let registration = HostRegistration::new(context, &mut host)?;
        assert_eq!(registration.len(), 8192);
        registration.unregister()?;
    }
    assert!(host.iter().all(|&b| b == 7));
    if managed_supported(context) {
        drop(ManagedAllocation::new(context, 64 << 10)?);
    }
    if pools_supported(context) {
        let pool = MemoryPool::new(context)?;
        pool.set_release_threshold(1 << 20)?;
        assert_eq!(pool.release_threshold()?, 1 << 20);
        assert_eq!(pool.used_bytes()?, 0);
        let _ = pool.reserved_bytes()?;
        pool.trim_to(0)?;
        drop(pool);
    }
    let module = Module::from_ptx(context, NOOP_PTX)?;
    drop(module.function("sixth_look_noop")?);
    drop(module);
    Ok(())
}

/// Asserts `result` is `GraphError::AlreadyCapturing`.
fn assert_already_capturing<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::Graph(GraphError::AlreadyCapturing { .. })) => {}
        other => panic!("{what}: expected AlreadyCapturing, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Unrecorded calls in relaxed mode, and the thread's own mode put back
// ---------------------------------------------------------------------------------------------

/// A PyTorch-style capture of a training step (global mode, and cuweave's thread-local mode)
/// during which the same thread allocates scratch memory, pins a staging buffer, makes and
/// tunes a private pool and loads a module (what `torch.cuda.graph` allows under a relaxed
/// allocator). The thread itself runs in global, then thread-local capture mode. Checks: every
/// call succeeds, the thread's mode is the one it set afterwards (each call enters relaxed mode
/// and must put the thread's mode back), the capture ends valid with exactly its two kernels,
/// and its graph replays an exact count.
#[test]
fn unrecorded_calls_on_the_capturing_thread_keep_the_capture_and_restore_the_threads_mode() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let mut expected = 0u32;
    for thread in [CaptureMode::Global, CaptureMode::ThreadLocal] {
        for capture in [CaptureMode::Global, CaptureMode::ThreadLocal] {
            let outer = CaptureModeGuard::enter(thread).unwrap();
            assert_eq!(thread_mode(), thread);
            stream.begin_capture(capture).unwrap();
            // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
            unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
            let calls = unrecorded_calls(context);
            let after = thread_mode();
            // SAFETY: as above.
            unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
            let ended = stream.end_capture();
            drop(outer);
            calls.unwrap_or_else(|error| {
                panic!("thread mode {thread:?}, {capture:?} capture: unrecorded call: {error}")
            });
            assert_eq!(
                after, thread,
                "the thread's capture mode after the unrecorded calls ({capture:?} capture)"
            );
            let graph = ended.unwrap_or_else(|error| {
                panic!("thread mode {thread:?}, {capture:?} capture broke: {error}")
            });
            assert_eq!(graph.node_count().unwrap(), 2);
            let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
            for _ in 0..10 {
                exec.launch(&stream).unwrap();
            }
            expected += 20;
        }
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [expected]);
}

/// A program that asks for more than the device has (a 1 PiB scratch buffer, 1 PiB of pinned
/// memory) and loads a corrupt PTX image while its thread-local or global capture is open,
/// catching the errors, as a caching allocator does before it frees its cache and retries.
/// Checks: each failure is the driver's error (not a capture refusal), the thread's mode is the
/// one it set after every failure (the relaxed switch is undone on the error path), and the
/// capture ends valid and replays exactly.
#[test]
fn failing_unrecorded_calls_inside_a_capture_restore_the_threads_mode_and_keep_the_capture() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let mut expected = 0u32;
    for mode in [CaptureMode::ThreadLocal, CaptureMode::Global] {
        let outer = CaptureModeGuard::enter(mode).unwrap();
        stream.begin_capture(mode).unwrap();
        // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
        unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
        let huge = DeviceAllocation::new(context, 1 << 50);
        let mode_after_alloc = thread_mode();
        let huge_pinned = HostAllocation::new(context, 1 << 50, HostAllocFlags::default());
        let mode_after_pin = thread_mode();
        let corrupt = Module::from_ptx(context, ".version 6.0\n.target sm_50\nthis is not ptx");
        let mode_after_load = thread_mode();
        let zero = DeviceAllocation::new(context, 0);
        let mode_after_zero = thread_mode();
        // SAFETY: as above.
        unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
        let ended = stream.end_capture();
        drop(outer);
        for (what, failed) in [
            ("1 PiB device allocation", huge.map(drop)),
            ("1 PiB pinned allocation", huge_pinned.map(drop)),
            ("corrupt PTX", corrupt.map(drop)),
        ] {
            match failed {
                Ok(()) => panic!("{what} succeeded"),
                Err(error) => assert!(
                    !error.is_capture_refusal(),
                    "{what} inside a {mode:?} capture was refused instead of made: {error}"
                ),
            }
        }
        assert!(
            matches!(zero, Err(DriverError::InvalidArgument { .. })),
            "zero bytes: {zero:?}"
        );
        assert_eq!(
            [
                mode_after_alloc,
                mode_after_pin,
                mode_after_load,
                mode_after_zero
            ],
            [mode; 4],
            "the thread's mode after each failed call ({mode:?} capture)"
        );
        let graph = ended.unwrap_or_else(|error| panic!("{mode:?} capture broke: {error}"));
        assert_eq!(graph.node_count().unwrap(), 2);
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
        for _ in 0..5 {
            exec.launch(&stream).unwrap();
        }
        expected += 10;
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [expected]);
    // A plain allocation works afterwards.
    drop(DeviceAllocation::new(context, 1 << 20).unwrap());
}

/// A data-loader thread that runs in global capture mode (the CUDA default) and allocates,
/// pins, makes pools and loads modules in a loop while the model thread captures global-mode
/// graphs over and over (PyTorch's default). Every such call is made in relaxed mode now, so
/// none may break a capture begun beside it, and none should be refused. Checks: every capture
/// ends valid, the loader's calls all succeed (a typed refusal is tolerated, a driver error is
/// not), its thread mode is still global afterwards, and sampled replays count exactly.
#[test]
fn unrecorded_calls_on_a_global_mode_thread_never_break_global_captures_begun_beside_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let stop = AtomicBool::new(false);
    let started = Barrier::new(2);
    let mut capture = CaptureRounds::default();
    let (ok, refused, other, mode_after) = std::thread::scope(|scope| {
        let loader = scope.spawn(|| {
            let _global = CaptureModeGuard::enter(CaptureMode::Global).unwrap();
            let (mut ok, mut refused, mut other) = (0usize, 0usize, Vec::new());
            started.wait();
            while !stop.load(Ordering::Acquire) {
                match unrecorded_calls(context) {
                    Ok(()) => ok += 1,
                    Err(error) if error.is_capture_refusal() => refused += 1,
                    Err(error) => {
                        if other.len() < 8 {
                            other.push(error.to_string());
                        }
                    }
                }
            }
            (ok, refused, other, thread_mode())
        });
        started.wait();
        let deadline = Instant::now() + Duration::from_secs(4);
        let mut round = 0;
        // At least a few loader rounds overlap the captures, however the threads are scheduled.
        while round < 3000 && Instant::now() < deadline {
            round += 1;
            capture.capture_increment(&stream, &kernels, counter.ptr(), round, 128);
        }
        stop.store(true, Ordering::Release);
        loader.join().unwrap()
    });
    assert!(
        capture.broken.is_empty() && other.is_empty(),
        "{} captures broke (first: {:?}); the loader's driver errors: {other:?} ({ok} rounds \
         made, {refused} refused)",
        capture.broken.len(),
        capture.broken.first()
    );
    assert!(ok > 0, "the loader's calls succeed beside global captures");
    assert_eq!(mode_after, CaptureMode::Global, "the loader's own mode");
    assert_eq!(
        read_u32(context, counter.ptr(), 1, &stream),
        [capture.replayed]
    );
}

// ---------------------------------------------------------------------------------------------
// Context::synchronize under the reentrant begin lock
// ---------------------------------------------------------------------------------------------

/// A serving process with eight worker threads that each call `torch.cuda.synchronize()`
/// (`Context::synchronize`) in a loop while the model thread captures 200 global-mode graphs.
/// `Context::synchronize` now holds the begin lock's read side with `read_recursive`, which
/// parking_lot grants while any other reader holds it even when a writer (a capture begin)
/// waits: eight overlapping synchronising threads can keep a capture begin waiting for as long
/// as they run. Checks: the 200 captures begin and end while the workers still synchronise
/// (within 8 s; each takes microseconds), every capture ends valid, the workers see only
/// successes and typed refusals, and the replayed graphs count exactly.
#[test]
fn capture_begins_are_not_starved_by_eight_threads_synchronising_the_context() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let stop = AtomicBool::new(false);
    let synchronised = AtomicUsize::new(0);
    let started = Barrier::new(9);
    const ROUNDS: usize = 200;
    let limit = Duration::from_secs(8);
    let mut done_rounds = 0usize;
    let mut capture = CaptureRounds::default();
    let (others, refused, finished_while_running) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..8)
            .map(|_| {
                scope.spawn(|| {
                    let (mut refused, mut other) = (0usize, Vec::new());
                    started.wait();
                    let hard_stop = Instant::now() + limit;
                    while !stop.load(Ordering::Acquire) && Instant::now() < hard_stop {
                        match context.synchronize() {
                            Ok(()) => {
                                synchronised.fetch_add(1, Ordering::Relaxed);
                            }
                            Err(error) if error.is_capture_refusal() => refused += 1,
                            Err(error) => {
                                if other.len() < 4 {
                                    other.push(error.to_string());
                                }
                            }
                        }
                    }
                    (refused, other)
                })
            })
            .collect();
        started.wait();
        // Let the workers get going (they may already be); the rounds below run either way.
        let _ = poll_until(Duration::from_secs(5), || {
            synchronised.load(Ordering::Relaxed) >= 64
        });
        let began = Instant::now();
        while done_rounds < ROUNDS {
            done_rounds += 1;
            capture.capture_increment(&stream, &kernels, counter.ptr(), done_rounds, 20);
        }
        let finished_while_running = began.elapsed() < limit;
        stop.store(true, Ordering::Release);
        let mut others = Vec::new();
        let mut refused = 0;
        for worker in workers {
            let (r, o) = worker.join().unwrap();
            refused += r;
            others.extend(o);
        }
        (others, refused, finished_while_running)
    });
    assert!(
        finished_while_running,
        "{ROUNDS} capture begins took longer than {limit:?} beside eight synchronising threads \
         (writer starvation of the begin lock: `while_no_capture_begins` uses read_recursive)"
    );
    assert!(
        capture.broken.is_empty() && others.is_empty(),
        "{} captures broke (first: {:?}); workers' driver errors: {others:?} ({refused} refused)",
        capture.broken.len(),
        capture.broken.first()
    );
    assert_eq!(
        read_u32(context, counter.ptr(), 1, &stream),
        [capture.replayed]
    );
    context.synchronize().unwrap();
}

/// A stream-owning library that frees through a weak handle inside
/// `WeakStream::with_no_capture_beginning` and, inside that closure, calls
/// `Context::synchronize` (the reentrant case the lock change was for) while the model thread
/// is already trying to begin a capture. Checks: no deadlock (the closure's synchronisation
/// returns Ok, the capture begins once the closure returns), the capture ends valid and replays
/// exactly, and a synchronisation inside the closure after the capture began is a typed refusal.
#[test]
fn synchronize_inside_with_no_capture_beginning_neither_deadlocks_nor_breaks_a_waiting_begin() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let capturing = non_blocking(context);
    let kernels = warmed_kernels(context, &capturing);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let weak = stream
        .downgrade()
        .expect("an owned stream has a weak handle");
    let inside = Barrier::new(2);
    let begun = AtomicBool::new(false);
    let (in_closure, after_begin) = std::thread::scope(|scope| {
        let holder = scope.spawn(|| {
            weak.with_no_capture_beginning(|_stream| {
                inside.wait();
                // The other thread is now (or soon) waiting in begin_capture's write lock.
                std::thread::sleep(Duration::from_millis(50));
                let first = context.synchronize();
                let second = context.synchronize();
                (first, second)
            })
            .expect("the stream lives")
        });
        inside.wait();
        capturing.begin_capture(CaptureMode::Global).unwrap();
        begun.store(true, Ordering::Release);
        let in_closure = holder.join().unwrap();
        // Now a capture is active: a synchronisation inside the closure is refused.
        let after_begin = weak
            .with_no_capture_beginning(|_stream| context.synchronize())
            .unwrap();
        (in_closure, after_begin)
    });
    assert!(begun.load(Ordering::Acquire));
    in_closure
        .0
        .expect("synchronize inside the closure, no capture active yet");
    in_closure
        .1
        .expect("a second synchronize inside the closure");
    assert!(
        matches!(&after_begin, Err(error) if error.is_capture_refusal()),
        "synchronize with a global capture active: {after_begin:?}"
    );
    // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
    unsafe { kernels.increment_u32(&capturing, counter.ptr(), 1) }.unwrap();
    let graph = capturing.end_capture().expect("the capture stayed valid");
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..7 {
        exec.launch(&capturing).unwrap();
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &capturing), [7]);
    drop(stream);
}

/// A program that keeps making mapped completion words, has a stream write into them and drops
/// them (what a dropped `AsyncEventWaiter` leaves), on one thread, while the model thread
/// captures global-mode graphs: the retirement thread synchronises the context for them through
/// `Context::synchronize` now, refused while a capture runs and retried. Checks: every capture
/// ends valid, each word read back before its drop holds the value written, and once the
/// captures are over every dropped allocation retires (`host_allocations_awaiting_free` returns
/// to 0).
#[test]
fn dropped_written_words_retire_after_global_captures_on_another_thread_without_breaking_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let capturing = non_blocking(context);
    let writer = non_blocking(context);
    let kernels = warmed_kernels(context, &capturing);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let stop = AtomicBool::new(false);
    let started = Barrier::new(2);
    let mut capture = CaptureRounds::default();
    let (written, wrong, errors) = std::thread::scope(|scope| {
        let dropper = scope.spawn(|| {
            let (mut written, mut wrong, mut errors) = (0usize, 0usize, Vec::new());
            started.wait();
            let mut value = 0u64;
            while !stop.load(Ordering::Acquire) && written < 400 {
                value += 1;
                // The write is waited for by polling the mapped word, not by synchronising the
                // stream: under another thread's global-mode capture CUDA forbids this thread's
                // synchronisations, and a check made just before one cannot stop a capture
                // beginning in between (the documented rule: capture in thread-local mode when
                // other threads synchronise).
                let outcome = MappedWords::new(context, 4).and_then(|words| {
                    words.enqueue_write(&writer, 1, value)?;
                    Ok(words)
                });
                if let Ok(words) = &outcome {
                    poll_until(Duration::from_secs(5), || words.load(1) == Some(value));
                }
                match outcome {
                    Ok(words) => {
                        written += 1;
                        if words.load(1) != Some(value) {
                            wrong += 1;
                        }
                        // A second write left queued when the words drop: retired, not freed.
                        match words.enqueue_write(&writer, 2, value) {
                            Ok(()) => {}
                            Err(error) if error.is_capture_refusal() => {}
                            Err(error) => {
                                if errors.len() < 4 {
                                    errors.push(error.to_string());
                                }
                            }
                        }
                        drop(words);
                    }
                    Err(error) if error.is_capture_refusal() => {}
                    Err(error) => {
                        if errors.len() < 4 {
                            errors.push(error.to_string());
                        }
                    }
                }
            }
            (written, wrong, errors)
        });
        started.wait();
        let deadline = Instant::now() + Duration::from_secs(4);
        let mut round = 0;
        while round < 2000 && Instant::now() < deadline {
            round += 1;
            capture.capture_increment(&capturing, &kernels, counter.ptr(), round, 100);
        }
        stop.store(true, Ordering::Release);
        dropper.join().unwrap()
    });
    assert!(
        capture.broken.is_empty() && errors.is_empty(),
        "{} captures broke (first: {:?}); the word thread's driver errors: {errors:?}",
        capture.broken.len(),
        capture.broken.first()
    );
    assert_eq!(
        wrong, 0,
        "words read back the value written ({written} rounds)"
    );
    assert_eq!(
        read_u32(context, counter.ptr(), 1, &capturing),
        [capture.replayed]
    );
    writer.synchronize().unwrap();
    assert!(
        poll_until(Duration::from_secs(10), || {
            memory::host_allocations_awaiting_free() == 0
        }),
        "dropped written words never retired once the captures were over ({} waiting)",
        memory::host_allocations_awaiting_free()
    );
}

// ---------------------------------------------------------------------------------------------
// begin_capture on a CUstream that already captures through another handle
// ---------------------------------------------------------------------------------------------

/// A cudarc interop layer wraps cuweave's `CUstream` in a borrowed handle and, not knowing the
/// stream already captures, begins a capture through it (plain and synchronized), in global and
/// thread-local mode. Checks: both begins are `AlreadyCapturing` (not the driver's error from a
/// flags query, which would have broken the capture), the thread's work keeps being recorded,
/// and the owner's capture ends valid with exactly its kernels and replays an exact count.
#[test]
fn begins_through_an_alias_of_a_capturing_stream_are_already_capturing_and_keep_the_capture() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let mut expected = 0u32;
    for mode in [CaptureMode::Global, CaptureMode::ThreadLocal] {
        stream.begin_capture(mode).unwrap();
        // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
        unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
        {
            // SAFETY: `stream` is live and outlives the alias, which does not own it.
            let alias = unsafe { Stream::from_raw(context, stream.as_raw(), false) };
            for begin_mode in [
                CaptureMode::Global,
                CaptureMode::ThreadLocal,
                CaptureMode::Relaxed,
            ] {
                assert_already_capturing(
                    alias.begin_capture(begin_mode),
                    &format!("alias begin_capture({begin_mode:?}) in a {mode:?} capture"),
                );
                assert_already_capturing(
                    alias.begin_capture_synchronized(begin_mode),
                    &format!(
                        "alias begin_capture_synchronized({begin_mode:?}) in a {mode:?} capture"
                    ),
                );
            }
            // SAFETY: as above.
            unsafe { kernels.increment_u32(&alias, counter.ptr(), 1) }.unwrap();
        }
        // The owner itself is refused the same way.
        assert_already_capturing(stream.begin_capture(mode), "the owner's second begin");
        let graph = stream
            .end_capture()
            .unwrap_or_else(|error| panic!("{mode:?} capture broke: {error}"));
        assert_eq!(graph.node_count().unwrap(), 2);
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
        for _ in 0..25 {
            exec.launch(&stream).unwrap();
        }
        expected += 50;
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [expected]);
    // With the capture over the alias can capture on its own.
    // SAFETY: as above.
    let alias = unsafe { Stream::from_raw(context, stream.as_raw(), false) };
    alias.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&alias, counter.ptr(), 1) }.unwrap();
    let graph = alias.end_capture().unwrap();
    graph
        .instantiate(&InstantiateOptions::default())
        .unwrap()
        .launch(&alias)
        .unwrap();
    alias.synchronize().unwrap();
    drop(alias);
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [expected + 1]);
}

/// A PyTorch-style fork/join capture (a side stream waits on an event recorded in the capturing
/// stream, so it joins the capture) in which a helper, unaware, begins a capture of its own on
/// the side stream, and on a borrowed alias of it, plain and synchronized. Checks: every begin
/// is `AlreadyCapturing`, the side stream's kernels keep being recorded, the join succeeds,
/// the origin's capture ends valid with all three kernels, and replays count exactly; in global
/// and thread-local mode.
#[test]
fn begins_on_a_stream_forked_into_another_capture_are_already_capturing_and_keep_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let origin = non_blocking(context);
    let side = non_blocking(context);
    let kernels = warmed_kernels(context, &origin);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let mut expected = 0u32;
    for mode in [CaptureMode::Global, CaptureMode::ThreadLocal] {
        let fork = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
        let join = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
        origin.begin_capture(mode).unwrap();
        // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
        unsafe { kernels.increment_u32(&origin, counter.ptr(), 1) }.unwrap();
        fork.record(&origin).unwrap();
        side.wait_event(&fork).unwrap();
        assert!(
            side.capture_status().unwrap().id().is_some(),
            "the side stream joined the capture"
        );
        for begin_mode in [CaptureMode::Global, CaptureMode::ThreadLocal] {
            assert_already_capturing(
                side.begin_capture(begin_mode),
                &format!("forked begin_capture({begin_mode:?}) in a {mode:?} capture"),
            );
            assert_already_capturing(
                side.begin_capture_synchronized(begin_mode),
                &format!("forked begin_capture_synchronized({begin_mode:?}) in a {mode:?} capture"),
            );
        }
        {
            // SAFETY: `side` is live and outlives the alias, which does not own it.
            let alias = unsafe { Stream::from_raw(context, side.as_raw(), false) };
            assert_already_capturing(
                alias.begin_capture(mode),
                "begin through an alias of the forked stream",
            );
            assert_already_capturing(
                alias.begin_capture_synchronized(mode),
                "synchronized begin through an alias of the forked stream",
            );
            match alias.end_capture() {
                Err(DriverError::Graph(GraphError::NotCapturing { .. })) => {}
                other => panic!("end through the forked alias: {other:?}"),
            }
        }
        match side.end_capture() {
            Err(DriverError::Graph(GraphError::NotCapturing { .. })) => {}
            other => panic!("end on the forked stream: {other:?}"),
        }
        // SAFETY: as above.
        unsafe { kernels.increment_u32(&side, counter.ptr(), 1) }.unwrap();
        join.record(&side).unwrap();
        origin.wait_event(&join).unwrap();
        // SAFETY: as above.
        unsafe { kernels.increment_u32(&origin, counter.ptr(), 1) }.unwrap();
        let graph = origin
            .end_capture()
            .unwrap_or_else(|error| panic!("{mode:?} fork/join capture broke: {error}"));
        assert_eq!(graph.node_count().unwrap(), 3);
        assert!(side.capture_status().unwrap().id().is_none());
        let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
        for _ in 0..20 {
            exec.launch(&origin).unwrap();
        }
        expected += 60;
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &origin), [expected]);
    // Afterwards the side stream captures on its own.
    side.begin_capture(CaptureMode::ThreadLocal).unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&side, counter.ptr(), 1) }.unwrap();
    side.end_capture().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Pool attributes and trims during captures
// ---------------------------------------------------------------------------------------------

/// A caching allocator's statistics thread (RMM's `cuda_async_memory_resource` reporting,
/// PyTorch's `memory_stats()`) reads a private pool's and the device default pool's
/// attributes and trims the private pool while the model thread holds a global capture open,
/// and the model thread reads them itself. Checks: every read and trim succeeds (they are made
/// in relaxed mode), the values are what the pool holds (used bytes the same as before
/// the capture; the threshold reads back; reserved covers the block), the capture ends valid and
/// replays exactly, and `trim_to(0)` empties the pool once the block is freed.
#[test]
fn pool_reads_and_trims_during_a_global_capture_succeed_with_exact_values_and_keep_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    if !pools_supported(context) {
        return;
    }
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    // The capturing thread in global mode (CUDA's default), set explicitly.
    let _global = CaptureModeGuard::enter(CaptureMode::Global).unwrap();
    let pool = MemoryPool::new(context).unwrap();
    pool.set_release_threshold(u64::MAX).unwrap();
    // SAFETY: freed below, after everything that uses it.
    let block = unsafe { pool.alloc_async(1 << 20, &stream) }.unwrap();
    stream.synchronize().unwrap();
    let used_before = pool.used_bytes().unwrap();
    assert!(
        (1 << 20..4 << 20).contains(&used_before),
        "{used_before} bytes used for one live 1 MiB block"
    );
    stream.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
    unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
    let mine = (
        pool.release_threshold(),
        pool.used_bytes(),
        pool.reserved_bytes(),
        pool.trim_to(0),
        thread_mode(),
    );
    let theirs = std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let _global = CaptureModeGuard::enter(CaptureMode::Global).unwrap();
                let default_threshold =
                    MemoryPool::device_default(context).and_then(|d| d.release_threshold());
                (
                    pool.release_threshold(),
                    pool.used_bytes(),
                    pool.reserved_bytes(),
                    pool.trim_to(1 << 20),
                    pool.set_release_threshold(u64::MAX),
                    default_threshold,
                    thread_mode(),
                )
            })
            .join()
            .unwrap()
    });
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) }.unwrap();
    let ended = stream.end_capture();
    assert_eq!(
        mine.0.unwrap(),
        u64::MAX,
        "threshold on the capturing thread"
    );
    assert_eq!(
        mine.1.unwrap(),
        used_before,
        "used bytes on the capturing thread"
    );
    assert!(
        mine.2.unwrap() >= used_before,
        "reserved covers the live block"
    );
    mine.3.expect("trim on the capturing thread");
    assert_eq!(mine.4, CaptureMode::Global, "the capturing thread's mode");
    assert_eq!(theirs.0.unwrap(), u64::MAX, "threshold on another thread");
    assert_eq!(
        theirs.1.unwrap(),
        used_before,
        "used bytes on another thread"
    );
    assert!(theirs.2.unwrap() >= used_before);
    theirs.3.expect("trim on another thread");
    theirs.4.expect("threshold set on another thread");
    theirs
        .5
        .expect("the device default pool's threshold on another thread");
    assert_eq!(theirs.6, CaptureMode::Global, "the other thread's mode");
    let graph = ended.expect("pool reads and trims left the global capture valid");
    assert_eq!(graph.node_count().unwrap(), 2);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..30 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [60]);
    // SAFETY: nothing uses `block` afterwards (synchronised above).
    unsafe { memory::free_async(block, &stream) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(pool.used_bytes().unwrap(), 0);
    pool.trim_to(0).unwrap();
    assert_eq!(pool.reserved_bytes().unwrap(), 0);
}
