//! A seventh look at the driver layer, aimed at the newest code: `graph::outside_captures` (the
//! gate that keeps queries nobody asked for out of a capture begin), `Event::query` and
//! `Stream::query` waiting out an announced begin, the begin lock, and how the calls users
//! make on other threads (queries, synchronisations, blocking copies and memsets, graph
//! instantiation, update, upload and launch) behave beside global-mode captures begun over and
//! over. Each test checks an outcome: captures that end valid and replay exact counts, bytes
//! that round-trip, typed refusals matched by variant, and liveness (no deadlock) of capture
//! begins made inside, beside and after `outside_captures` sections (a watchdog turns a hang
//! into a failure).

mod common;

use common::{CaptureRounds, non_blocking, read_u32, warmed_kernels};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, mpsc};
use std::time::{Duration, Instant};

use cuweave_driver::graph::{GraphNodeType, outside_captures};
use cuweave_driver::memory::{self, DeviceAllocation};
use cuweave_driver::{
    CaptureMode, Context, DriverError, Event, EventFlags, GraphError, InstantiateOptions, Stream,
};
use cuweave_test_support::{poll_until, require_gpu, serial};

/// What the threads beside the capturing one saw.
#[derive(Debug, Default)]
struct Beside {
    ok: usize,
    refused: usize,
    /// Errors other than a typed capture refusal (first few).
    other: Vec<String>,
}

impl Beside {
    fn note<T>(&mut self, what: &str, result: Result<T, DriverError>) -> Option<T> {
        match result {
            Ok(value) => {
                self.ok += 1;
                Some(value)
            }
            Err(error) if error.is_capture_refusal() => {
                self.refused += 1;
                None
            }
            Err(error) => {
                if self.other.len() < 8 {
                    self.other.push(format!("{what}: {error}"));
                }
                None
            }
        }
    }

    fn merge(&mut self, other: Beside) {
        self.ok += other.ok;
        self.refused += other.refused;
        self.other.extend(other.other);
    }
}

/// Runs `rounds` global-mode capture rounds (one increment each, every 64th replayed) on this
/// thread, for at most `limit`, while `threads` threads each run `call(thread, &mut beside)` in
/// a loop; every thread makes its first call before the rounds start. Checks the counter
/// against the replayed graphs and returns the rounds and what the other threads saw.
fn race_global_captures(
    context: &Arc<Context>,
    rounds: usize,
    limit: Duration,
    threads: usize,
    call: impl Fn(usize, &mut Beside) + Sync,
) -> (CaptureRounds, Beside) {
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let stop = AtomicBool::new(false);
    let started = Barrier::new(threads + 1);
    let mut capture = CaptureRounds::default();
    let beside = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads)
            .map(|thread| {
                let (call, stop, started) = (&call, &stop, &started);
                scope.spawn(move || {
                    let mut seen = Beside::default();
                    call(thread, &mut seen);
                    started.wait();
                    while !stop.load(Ordering::Acquire) {
                        call(thread, &mut seen);
                    }
                    seen
                })
            })
            .collect();
        started.wait();
        let deadline = Instant::now() + limit;
        let mut round = 0;
        while round < rounds && Instant::now() < deadline {
            round += 1;
            capture.capture_increment(&stream, &kernels, counter.ptr(), round, 64);
        }
        stop.store(true, Ordering::Release);
        let mut beside = Beside::default();
        for worker in workers {
            beside.merge(worker.join().unwrap());
        }
        beside
    });
    assert_eq!(
        read_u32(context, counter.ptr(), 1, &stream),
        [capture.replayed],
        "each replayed graph incremented once, and nothing captured ran eagerly"
    );
    (capture, beside)
}

/// Runs `f` on a thread of its own and waits up to `limit` for its answer: `None` when it did
/// not come (a deadlock; the thread is left behind).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (send, receive) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = send.send(f());
    });
    receive.recv_timeout(limit).ok()
}

/// One global-mode capture of one increment of `counter` on a fresh stream, ended, replayed
/// once and synchronised: what a thread does to prove a capture can still begin.
fn one_capture_round(context: &Arc<Context>) -> Result<u32, DriverError> {
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4)?;
    stream.begin_capture(CaptureMode::Global)?;
    // SAFETY: `counter` holds one u32 and outlives the launch (synchronised below).
    let launched = unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) };
    let graph = stream.end_capture()?;
    launched?;
    graph
        .instantiate(&InstantiateOptions::default())?
        .launch(&stream)?;
    Ok(read_u32(context, counter.ptr(), 1, &stream)[0])
}

fn assert_capture_refusal<T: std::fmt::Debug>(result: Result<T, DriverError>, what: &str) {
    match result {
        Err(DriverError::Graph(GraphError::Capturing { .. })) => {}
        other => panic!("{what}: expected GraphError::Capturing, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// User calls on other threads beside global captures begun over and over
// ---------------------------------------------------------------------------------------------

/// A metrics thread pool (four threads) polling `event.query()` and `stream.query()` on their
/// own streams' work, as a cudarc program's progress reporter does, while the model thread
/// captures a step in global mode (PyTorch's default) up to 2000 times. Both queries now run
/// their refusal check and the query between capture begins. Checks: every capture ends valid
/// and the replayed graphs count exactly; the pollers see only answers and typed refusals.
#[test]
fn queries_on_four_threads_never_break_global_captures_begun_beside_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let streams: Vec<Stream> = (0..4).map(|_| non_blocking(context)).collect();
    let events: Vec<Event> = streams
        .iter()
        .map(|stream| {
            let event = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
            event.record(stream).unwrap();
            event
        })
        .collect();
    let (capture, beside) =
        race_global_captures(context, 2000, Duration::from_secs(5), 4, |thread, seen| {
            seen.note("Event::query", events[thread].query());
            seen.note("Stream::query", streams[thread].query());
        });
    assert!(
        capture.broken.is_empty() && beside.other.is_empty(),
        "{} captures broke (first: {:?}); pollers' errors: {:?} ({} answered, {} refused)",
        capture.broken.len(),
        capture.broken.first(),
        beside.other,
        beside.ok,
        beside.refused
    );
    assert!(beside.ok >= 8, "every poller answered before the rounds");
}

/// Four worker threads that each queue a short kernel on their own stream and then wait for it
/// with `stream.synchronize()` or `event.synchronize()` (what `torch.cuda.current_stream()
/// .synchronize()` and cudarc's `stream.synchronize()` do) while the model thread captures in
/// global mode. Under a global capture any synchronisation on any thread invalidates it, so
/// cuweave refuses both while it counts a capture; a check followed by the driver call leaves a
/// window in which a capture can begin (the race `Context::synchronize` and the queries close
/// with the begin lock and the gate). Checks: every capture ends valid and replays exactly; the
/// workers see only successes and typed refusals.
#[test]
fn stream_and_event_synchronize_on_four_threads_never_break_global_captures_begun_beside_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let streams: Vec<Stream> = (0..4).map(|_| non_blocking(context)).collect();
    let events: Vec<Event> = (0..4)
        .map(|_| Event::new(context, EventFlags::DISABLE_TIMING).unwrap())
        .collect();
    let kernels = warmed_kernels(context, &streams[0]);
    let iteration = AtomicUsize::new(0);
    let (capture, beside) =
        race_global_captures(context, 2000, Duration::from_secs(6), 4, |thread, seen| {
            let (stream, event) = (&streams[thread], &events[thread]);
            seen.note("spin_ns", kernels.spin_ns(stream, 2_000));
            if iteration.fetch_add(1, Ordering::Relaxed).is_multiple_of(2) {
                seen.note("Stream::synchronize", stream.synchronize());
            } else if seen.note("Event::record", event.record(stream)).is_some() {
                seen.note("Event::synchronize", event.synchronize());
            }
        });
    assert!(
        capture.broken.is_empty() && beside.other.is_empty(),
        "{} of the captures broke (first: {:?}); workers' errors: {:?} ({} ok, {} refused)",
        capture.broken.len(),
        capture.broken.first(),
        beside.other,
        beside.ok,
        beside.refused
    );
    for stream in &streams {
        stream.synchronize().unwrap();
    }
}

/// A data-loader thread that stages each batch with blocking copies and memsets
/// (`memory::copy_htod`, `memset_d32`, `copy_dtoh`: what `tensor.to("cuda")` and `.cpu()` do)
/// while the model thread captures global-mode graphs. Each blocking form checks for captures,
/// makes its copy, then synchronises the legacy default stream: a capture begun after the check
/// (during the copy, which takes microseconds) sees a synchronous copy and a stream
/// synchronisation from another thread, which invalidate a global capture. Checks: every
/// capture ends valid; the loader sees only successes and typed refusals, and every batch whose
/// three calls all succeeded reads back exactly what was written.
#[test]
fn blocking_copies_and_memsets_on_a_loader_thread_never_break_global_captures_begun_beside_them() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    const WORDS: usize = 64 << 10;
    let staging = DeviceAllocation::new(context, WORDS * 4).unwrap();
    let batch = AtomicUsize::new(0);
    let exact = AtomicUsize::new(0);
    let (capture, beside) =
        race_global_captures(context, 2000, Duration::from_secs(6), 1, |_, seen| {
            let n = batch.fetch_add(1, Ordering::Relaxed) as u32;
            let host: Vec<u32> = (0..WORDS as u32)
                .map(|i| i ^ n.wrapping_mul(0x9E37))
                .collect();
            // SAFETY: `staging` holds WORDS u32s; `host` holds as many; nothing else uses them.
            let written = unsafe {
                memory::copy_htod(context, staging.ptr(), host.as_ptr().cast(), WORDS * 4)
            };
            if seen.note("copy_htod", written).is_none() {
                return;
            }
            // SAFETY: the first 16 words of `staging`.
            let set = unsafe { memory::memset_d32(context, staging.ptr(), n, 16) };
            if seen.note("memset_d32", set).is_none() {
                return;
            }
            let mut back = vec![0u32; WORDS];
            // SAFETY: as above, into `back`.
            let read = unsafe {
                memory::copy_dtoh(context, back.as_mut_ptr().cast(), staging.ptr(), WORDS * 4)
            };
            if seen.note("copy_dtoh", read).is_none() {
                return;
            }
            let mut expected = host;
            expected[..16].fill(n);
            assert_eq!(back, expected, "batch {n} read back");
            exact.fetch_add(1, Ordering::Relaxed);
        });
    assert!(
        capture.broken.is_empty() && beside.other.is_empty(),
        "{} of the captures broke (first: {:?}); the loader's errors: {:?} ({} ok, {} refused)",
        capture.broken.len(),
        capture.broken.first(),
        beside.other,
        beside.ok,
        beside.refused
    );
    assert!(
        exact.load(Ordering::Relaxed) >= 1,
        "the first batch round-trips"
    );
}

/// A serving thread that, for each request, instantiates a pre-captured graph, uploads it,
/// launches it, updates it to a second graph of the same shape, launches it again and drops it
/// (CUTLASS/TensorRT-style graph caches do this), while the model thread captures global-mode
/// graphs. None of these calls is recorded by a capture; if the driver counts any of them as
/// unsafe under another thread's global capture, cuweave must refuse it or make it in relaxed
/// mode (as it does allocations and module loads). Checks: every capture ends valid; the
/// serving thread sees only successes and typed refusals; each of its two counters equals the
/// launches of its graph that succeeded.
#[test]
fn a_graph_server_instantiating_updating_and_launching_beside_global_captures_keeps_them_valid() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let serve = non_blocking(context);
    let kernels = warmed_kernels(context, &serve);
    let first = DeviceAllocation::zeroed(context, 4).unwrap();
    let second = DeviceAllocation::zeroed(context, 4).unwrap();
    let capture_into = |counter: &DeviceAllocation| {
        serve.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
        let launched = unsafe { kernels.increment_u32(&serve, counter.ptr(), 1) };
        let graph = serve.end_capture().unwrap();
        launched.unwrap();
        graph
    };
    let graph_first = capture_into(&first);
    let graph_second = capture_into(&second);
    let launched_first = AtomicUsize::new(0);
    let launched_second = AtomicUsize::new(0);
    let (capture, beside) =
        race_global_captures(context, 1000, Duration::from_secs(6), 1, |_, seen| {
            let Some(mut exec) = seen.note(
                "instantiate",
                graph_first.instantiate(&InstantiateOptions::default()),
            ) else {
                return;
            };
            seen.note("upload", exec.upload(&serve));
            if seen.note("launch", exec.launch(&serve)).is_some() {
                launched_first.fetch_add(1, Ordering::Relaxed);
            }
            if seen.note("update", exec.update(&graph_second)).is_some()
                && seen.note("launch", exec.launch(&serve)).is_some()
            {
                launched_second.fetch_add(1, Ordering::Relaxed);
            }
            drop(exec);
        });
    assert!(
        capture.broken.is_empty() && beside.other.is_empty(),
        "{} of the captures broke (first: {:?}); the server's errors: {:?} ({} ok, {} refused)",
        capture.broken.len(),
        capture.broken.first(),
        beside.other,
        beside.ok,
        beside.refused
    );
    assert_eq!(
        read_u32(context, first.ptr(), 1, &serve),
        [launched_first.load(Ordering::Relaxed) as u32]
    );
    assert_eq!(
        read_u32(context, second.ptr(), 1, &serve),
        [launched_second.load(Ordering::Relaxed) as u32]
    );
    assert!(launched_first.load(Ordering::Relaxed) >= 1);
}

// ---------------------------------------------------------------------------------------------
// outside_captures: the gate itself, used by a library of the user's own
// ---------------------------------------------------------------------------------------------

/// A user's own caching layer that settles its pending frees by querying their events inside
/// `outside_captures` (as cuweave's allocator does), on four threads, while the model thread
/// captures in global mode. The promise: the closure runs only while no capture is active or
/// beginning, so a query inside is never refused (a refusal would mean it ran during a
/// capture) and never breaks one. Checks: every answer from inside is `Ok`, some closures ran,
/// every capture ends valid and replays exactly.
#[test]
fn outside_captures_sections_on_four_threads_never_run_during_a_global_capture() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let streams: Vec<Stream> = (0..4).map(|_| non_blocking(context)).collect();
    let events: Vec<Event> = streams
        .iter()
        .map(|stream| {
            let event = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
            event.record(stream).unwrap();
            event
        })
        .collect();
    let ran = AtomicUsize::new(0);
    let skipped = AtomicUsize::new(0);
    let (capture, beside) =
        race_global_captures(context, 2000, Duration::from_secs(5), 4, |thread, seen| {
            let answer = outside_captures(|| {
                let answers = (events[thread].query(), streams[thread].query());
                // Nested: the outer section already keeps captures out, so this runs too.
                let nested = outside_captures(|| events[thread].query());
                (answers, nested)
            });
            match answer {
                Some(((event, stream), nested)) => {
                    ran.fetch_add(1, Ordering::Relaxed);
                    for (what, result) in [("query inside", event), ("stream query inside", stream)]
                    {
                        if let Err(error) = result {
                            seen.other.push(format!("{what}: {error}"));
                        }
                    }
                    match nested {
                        Some(Ok(_)) => {}
                        other => seen.other.push(format!("nested section: {other:?}")),
                    }
                }
                None => {
                    skipped.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    assert!(
        capture.broken.is_empty() && beside.other.is_empty(),
        "{} captures broke (first: {:?}); inside the sections: {:?}",
        capture.broken.len(),
        capture.broken.first(),
        &beside.other[..beside.other.len().min(8)]
    );
    assert!(
        ran.load(Ordering::Relaxed) >= 4,
        "each thread's first section ran"
    );
}

/// A library that, inside its own `outside_captures` section, begins a global capture, against
/// the documented contract, two levels deep. A begin waits for every section to end, so one made
/// inside a section could wait for itself once another thread's begin holds the begin lock:
/// it is refused instead. Checks: the begin is a typed capture refusal, the stream is left not
/// capturing (its query answers), a begin after the section captures one kernel whose graph
/// replays three times exactly, and afterwards another thread's section runs and another
/// thread's capture begins and ends (within 20 s: no count was left behind).
#[test]
fn a_capture_begun_inside_outside_captures_is_refused_and_the_gate_reopens() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let kernels = warmed_kernels(context, &stream);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let begun = outside_captures(|| outside_captures(|| stream.begin_capture(CaptureMode::Global)))
        .expect("no capture was active at the outer section")
        .expect("nested in a running section");
    assert_capture_refusal(begun, "a capture begun inside an outside_captures section");
    assert_eq!(
        stream.query(),
        Ok(true),
        "the refused begin left the stream eager and idle"
    );
    stream.begin_capture(CaptureMode::Global).unwrap();
    // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
    let launched = unsafe { kernels.increment_u32(&stream, counter.ptr(), 1) };
    let graph = stream.end_capture();
    launched.unwrap();
    let graph = graph.expect("the capture begun after the section ends valid");
    assert_eq!(graph.node_types().unwrap(), [GraphNodeType::Kernel]);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..3 {
        exec.launch(&stream).unwrap();
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &stream), [3]);

    let other = within(Duration::from_secs(20), || outside_captures(|| 5));
    assert_eq!(other, Some(Some(5)), "another thread's section runs");
    let owned = Arc::clone(context);
    let begun = within(Duration::from_secs(20), move || one_capture_round(&owned))
        .expect("a capture begun on another thread after the section finished (no deadlock)");
    assert_eq!(begun.unwrap(), 1);
}

/// The deadlock shape of that misuse: one thread tries 500 global-capture begins, each inside
/// its own `outside_captures` section, while another thread begins and ends 500 global
/// captures plainly and three threads poll an event and a stream and run sections of their
/// own. Unrefused, the section's begin would wait for the begin lock while the plain begin
/// holding it waited for the section. Checks (under a 60 s watchdog): everything finishes;
/// every begin made inside a section that ran is a typed refusal; the plain captures end valid
/// and their replays count exactly; the pollers saw only answers and typed refusals, and their
/// own sections' queries always answered.
#[test]
fn captures_begun_inside_sections_beside_plain_begins_and_pollers_never_deadlock() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = Arc::clone(&gpu.context);
    let outcome = within(Duration::from_secs(60), move || {
        let context = &context;
        let stream = non_blocking(context);
        let inside_stream = non_blocking(context);
        let kernels = warmed_kernels(context, &stream);
        let counter = DeviceAllocation::zeroed(context, 4).unwrap();
        let polled: Vec<(Stream, Event)> = (0..3)
            .map(|_| {
                let stream = non_blocking(context);
                let event = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
                event.record(&stream).unwrap();
                (stream, event)
            })
            .collect();
        let stop = AtomicBool::new(false);
        let started = Barrier::new(5);
        let mut capture = CaptureRounds::default();
        let (beside, inside) = std::thread::scope(|scope| {
            let pollers: Vec<_> = polled
                .iter()
                .map(|(stream, event)| {
                    let (stop, started) = (&stop, &started);
                    scope.spawn(move || {
                        let mut seen = Beside::default();
                        started.wait();
                        while !stop.load(Ordering::Acquire) {
                            seen.note("Event::query", event.query());
                            seen.note("Stream::query", stream.query());
                            if let Some(Err(error)) = outside_captures(|| event.query()) {
                                seen.other.push(format!("query inside a section: {error}"));
                            }
                        }
                        seen
                    })
                })
                .collect();
            let inside_stream = &inside_stream;
            let started_inside = &started;
            let in_sections = scope.spawn(move || {
                let mut seen = Beside::default();
                started_inside.wait();
                for _ in 0..500 {
                    if let Some(begun) =
                        outside_captures(|| inside_stream.begin_capture(CaptureMode::Global))
                    {
                        match begun {
                            Ok(()) => {
                                seen.other.push("a begin inside a section was made".into());
                                let _ = inside_stream.end_capture();
                            }
                            Err(error) if error.is_capture_refusal() => seen.refused += 1,
                            Err(error) => seen.other.push(format!("begin: {error}")),
                        }
                    }
                }
                seen
            });
            started.wait();
            for round in 1..=500 {
                capture.capture_increment(&stream, &kernels, counter.ptr(), round, 25);
            }
            let inside = in_sections.join().unwrap();
            stop.store(true, Ordering::Release);
            let mut beside = Beside::default();
            for poller in pollers {
                beside.merge(poller.join().unwrap());
            }
            (beside, inside)
        });
        let count = read_u32(context, counter.ptr(), 1, &stream)[0];
        (capture, beside, inside, count)
    });
    let (capture, beside, inside, count) =
        outcome.expect("500 plain captures beside 500 begins inside sections finish (no deadlock)");
    assert!(
        inside.other.is_empty(),
        "begins inside sections: {:?}",
        inside.other
    );
    assert!(
        capture.broken.is_empty() && beside.other.is_empty(),
        "{} captures broke (first: {:?}); pollers' errors: {:?}",
        capture.broken.len(),
        capture.broken.first(),
        &beside.other[..beside.other.len().min(8)]
    );
    assert_eq!(count, capture.replayed);
    assert_eq!(capture.replayed, 20);
}

/// A user's section that panics (a bug in the closure, caught by a request handler's
/// `catch_unwind`), once at the outermost level and once nested, on the test's own thread,
/// which stays alive afterwards. A count left in the thread's shard would make every later
/// capture begin wait for ever. Checks: both panics propagate; this thread's next sections run
/// (also nested); a capture begun on another thread begins, ends and replays (within 20 s).
#[test]
fn a_panic_inside_outside_captures_leaves_no_count_that_stalls_a_capture_begin() {
    let gpu = require_gpu!();
    let _serial = serial();
    let outer = catch_unwind(AssertUnwindSafe(|| {
        outside_captures(|| -> u32 { panic!("seventh-look probe: a panicking section") })
    }));
    assert!(outer.is_err());
    let nested = catch_unwind(AssertUnwindSafe(|| {
        outside_captures(|| {
            outside_captures(|| -> u32 { panic!("seventh-look probe: a panicking nested section") })
        })
    }));
    assert!(nested.is_err());
    assert_eq!(outside_captures(|| outside_captures(|| 7)), Some(Some(7)));
    let context = Arc::clone(&gpu.context);
    let begun = within(Duration::from_secs(20), move || one_capture_round(&context))
        .expect("a capture begins on another thread after the panics (no count left behind)");
    assert_eq!(begun.unwrap(), 1);
}

/// A cudarc-style fork inside a thread-local capture: the model thread records an event into
/// its capture (the fork point a side stream would wait on) while a monitoring thread, which
/// keeps a handle to that event, polls it and the capturing stream. A captured event has not
/// happened (it is an edge of a graph, not work that ran) and querying the capturing stream
/// would break the capture. Checks: the monitor's stream query is a typed refusal; its event
/// query does not report the captured work done (`Ok(true)`); the capture ends valid with its
/// two kernels and its graph replays an exact count.
#[test]
fn polling_an_event_recorded_into_another_threads_capture_never_reports_it_done_nor_breaks_it() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let origin = non_blocking(context);
    let kernels = warmed_kernels(context, &origin);
    let counter = DeviceAllocation::zeroed(context, 4).unwrap();
    let fork_point = Event::new(context, EventFlags::DISABLE_TIMING).unwrap();
    let recorded = AtomicBool::new(false);
    let polled = AtomicBool::new(false);
    let (event_answer, stream_answer, graph) = std::thread::scope(|scope| {
        let monitor = scope.spawn(|| {
            assert!(poll_until(Duration::from_secs(20), || recorded.load(Ordering::Acquire)));
            let answers = (fork_point.query(), origin.query());
            polled.store(true, Ordering::Release);
            answers
        });
        origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
        // SAFETY: `counter` holds one u32 and outlives every launch (synchronised below).
        let first = unsafe { kernels.increment_u32(&origin, counter.ptr(), 1) };
        let record = fork_point.record(&origin);
        recorded.store(true, Ordering::Release);
        let waited = poll_until(Duration::from_secs(20), || polled.load(Ordering::Acquire));
        // SAFETY: as above.
        let second = unsafe { kernels.increment_u32(&origin, counter.ptr(), 1) };
        let graph = origin.end_capture();
        first.unwrap();
        record.unwrap();
        second.unwrap();
        assert!(waited, "the monitor polled");
        let (event_answer, stream_answer) = monitor.join().unwrap();
        (event_answer, stream_answer, graph)
    });
    assert_capture_refusal(stream_answer, "querying another thread's capturing stream");
    assert!(
        !matches!(event_answer, Ok(true)),
        "a query of an event recorded into a running capture reported the captured work done"
    );
    let graph = graph.unwrap_or_else(|error| {
        panic!(
            "the capture broke after the monitor polled (event query: {event_answer:?}): {error}"
        )
    });
    let kernels_in_graph = graph
        .node_types()
        .unwrap()
        .into_iter()
        .filter(|kind| *kind == GraphNodeType::Kernel)
        .count();
    assert_eq!(kernels_in_graph, 2);
    let exec = graph.instantiate(&InstantiateOptions::default()).unwrap();
    for _ in 0..5 {
        exec.launch(&origin).unwrap();
    }
    assert_eq!(read_u32(context, counter.ptr(), 1, &origin), [10]);
}

// ---------------------------------------------------------------------------------------------
// Pure CPU: the gate without a driver
// ---------------------------------------------------------------------------------------------

/// A library that wraps its housekeeping in `outside_captures` on sixteen threads, nesting
/// sections three deep, and whose closures sometimes panic (caught). Needs no driver: with no
/// capture active, every section runs and hands its value back. Checks: every value comes back
/// exactly, nested sections run, and a thread whose section panicked keeps running sections.
#[test]
fn outside_captures_nests_on_sixteen_threads_and_survives_panics_without_a_driver() {
    // No capture of another test may be active meanwhile (GPU tests of this binary begin some).
    let _serial = serial();
    let total = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for thread in 0..16usize {
            let total = &total;
            scope.spawn(move || {
                for round in 0..2_000usize {
                    if round % 500 == 499 {
                        let caught = catch_unwind(AssertUnwindSafe(|| {
                            outside_captures(|| {
                                outside_captures(|| -> usize { panic!("probe panic {thread}") })
                            })
                        }));
                        assert!(caught.is_err());
                        continue;
                    }
                    let value = outside_captures(|| {
                        outside_captures(|| outside_captures(|| thread * 10_000 + round))
                    });
                    assert_eq!(value, Some(Some(Some(thread * 10_000 + round))));
                    total.fetch_add(1, Ordering::Relaxed);
                }
                assert_eq!(outside_captures(|| thread), Some(thread));
            });
        }
    });
    assert_eq!(total.load(Ordering::Relaxed), 16 * (2_000 - 4));
}

/// A library that queues a stream-ordered free inside `WeakStream::with_no_capture_beginning`
/// and, against its contract, begins a capture there: the begin would wait for the begin lock
/// its own thread holds. Checks: the begin is a typed capture refusal, the stream is left eager
/// and idle, and a capture begun right after the section ends valid (within 20 s: nothing was
/// left holding begins off).
#[test]
fn a_capture_begun_inside_with_no_capture_beginning_is_refused() {
    let gpu = require_gpu!();
    let _serial = serial();
    let context = &gpu.context;
    let stream = non_blocking(context);
    let weak = stream
        .downgrade()
        .expect("an owned stream has a weak handle");
    let begun = weak
        .with_no_capture_beginning(|stream| stream.begin_capture(CaptureMode::Global))
        .expect("the stream is alive");
    assert_capture_refusal(begun, "a capture begun while this thread holds begins off");
    assert_eq!(stream.query(), Ok(true), "the stream stayed eager");
    let owned = Arc::clone(context);
    let round = within(Duration::from_secs(20), move || one_capture_round(&owned))
        .expect("a capture begins after the section (no lock left held)");
    assert_eq!(round.unwrap(), 1);
}
