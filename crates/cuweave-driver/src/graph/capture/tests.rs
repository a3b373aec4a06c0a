//! Unit tests of the capture bookkeeping that need no GPU: the failure log, the state word,
//! the status helpers, and the refusals while no capture is active.

use std::sync::atomic::Ordering;

use super::begin_end::is_legacy_default;
use super::failures::{FAILURE_LOG, FAILURE_SEQ, FAILURES, Failure, first_failure_after};
use super::registry::{COUNT_BITS, STATE};
use super::*;
use crate::sys;

#[test]
fn the_failure_log_is_bounded_and_finds_the_first_after_a_point() {
    let _count = CAPTURE_COUNT_TEST_LOCK.lock();
    // Not noted while no capture is active (the other tests that touch the count hold the
    // lock too).
    let before = FAILURE_SEQ.load(Ordering::Acquire);
    note_driver_failure(
        sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
        "cuTest",
    );
    assert_eq!(FAILURE_SEQ.load(Ordering::Acquire), before);
    STATE.fetch_add(1, Ordering::AcqRel);
    let start = FAILURE_SEQ.load(Ordering::Acquire);
    note_driver_failure(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY, "cuIgnored");
    // A consequence, not a cause: never noted.
    note_driver_failure(
        sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
        "cuConsequence",
    );
    for _ in 0..100_000 {
        note_driver_failure(
            sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "cuLater",
        );
    }
    STATE.fetch_sub(1, Ordering::AcqRel);
    assert!(FAILURES.lock().len() <= FAILURE_LOG);
    // With no capture recorded, nobody asks about old failures: the log keeps the newest.
    assert!(first_failure_after(start, None).is_some_and(|first| first.operation == "cuLater"));
    let last = FAILURE_SEQ.load(Ordering::Acquire);
    assert!(first_failure_after(last, None).is_none());
}

#[test]
fn a_capture_looks_first_at_its_own_threads_failures() {
    let _count = CAPTURE_COUNT_TEST_LOCK.lock();
    let here = std::thread::current().id();
    let other = std::thread::spawn(|| std::thread::current().id())
        .join()
        .unwrap();
    // Another thread broke its capture first, then this one broke its own.
    let start = FAILURE_SEQ.fetch_add(2, Ordering::AcqRel);
    {
        let mut failures = FAILURES.lock();
        failures.clear();
        for (seq, operation, thread) in [
            (start + 1, "cuOtherThread", other),
            (start + 2, "cuThisThread", here),
        ] {
            failures.push_back(Failure {
                seq,
                operation,
                code: sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                thread,
            });
        }
    }
    let operation = |thread| first_failure_after(start, thread).map(|f| f.operation);
    assert_eq!(operation(Some(here)), Some("cuThisThread"));
    assert_eq!(operation(Some(other)), Some("cuOtherThread"));
    // A global capture (no thread) is broken by the first failure anywhere; a thread with
    // no failure of its own is given that one too.
    assert_eq!(operation(None), Some("cuOtherThread"));
    let third = std::thread::spawn(|| std::thread::current().id())
        .join()
        .unwrap();
    assert_eq!(operation(Some(third)), Some("cuOtherThread"));
    FAILURES.lock().clear();
}

#[test]
fn the_state_word_holds_the_count_below_the_epoch() {
    let word = (7u64 << COUNT_BITS) | 3;
    assert_eq!(
        CaptureState::from_word(word),
        CaptureState {
            active: 3,
            epoch: 7
        }
    );
    // A bump of the epoch never touches the count, nor a count change the epoch.
    let bumped = CaptureState::from_word(word + (1 << COUNT_BITS) - 1);
    assert_eq!((bumped.active, bumped.epoch), (2, 8));
    assert!(!capture_is_active(u64::MAX));
}

#[test]
fn status_helpers() {
    assert!(!CaptureStatus::None.is_capturing());
    assert!(CaptureStatus::Active { id: 3 }.is_capturing());
    assert_eq!(CaptureStatus::Invalidated { id: 4 }.id(), Some(4));
    assert!(is_legacy_default(std::ptr::null_mut()));
    assert!(is_legacy_default(1 as sys::CUstream));
    assert!(!is_legacy_default(2 as sys::CUstream));
}

#[test]
fn no_capture_means_nothing_is_refused() {
    let _count = CAPTURE_COUNT_TEST_LOCK.lock();
    // No unit test of this crate begins a real capture.
    assert_eq!(active_captures(), 0);
    assert!(refuse_while_capturing(None, "op").is_ok());
}

/// A synchronised begin on one thread races another thread's: the interleavings of
/// `synchronized_bound`, with the registry played by cells.
mod synchronized_begin {
    use std::cell::Cell;

    use super::super::begin_end::synchronized_bound;
    use crate::error::DriverError;
    use crate::graph::GraphError;

    fn refused() -> DriverError {
        GraphError::Capturing {
            operation: "Context::synchronize",
            reason: "a context synchronisation waits on the capturing streams too",
        }
        .into()
    }

    #[test]
    fn with_no_capture_active_the_context_is_synchronised() {
        let bound = synchronized_bound(|| 0, || Ok(9), || panic!("nothing to inherit"));
        assert_eq!(bound.unwrap(), 9);
    }

    #[test]
    fn a_begin_that_loses_the_race_inherits_the_winners_bound() {
        // Between this begin's count check and its synchronisation, another thread's
        // synchronised begin (epoch 5) recorded and counted its capture: the synchronisation is
        // refused, and the bound must be read after that, not before.
        let (active, bound) = (Cell::new(0), Cell::new(0));
        let got = synchronized_bound(
            || active.get(),
            || {
                bound.set(5);
                active.set(1);
                Err(refused())
            },
            || bound.get(),
        );
        assert_eq!(got.unwrap(), 5);
    }

    #[test]
    fn a_capture_already_active_is_inherited_from_without_synchronising() {
        let got = synchronized_bound(|| 1, || panic!("must not synchronise"), || 3);
        assert_eq!(got.unwrap(), 3);
        // An active capture that knows nothing (raw begin, other context): nothing known.
        let got = synchronized_bound(|| 1, || panic!("must not synchronise"), || 0);
        assert_eq!(got.unwrap(), 0);
    }

    #[test]
    fn when_the_capture_that_refused_ended_meanwhile_the_synchronisation_is_retried() {
        let attempts = Cell::new(0);
        let got = synchronized_bound(
            || 0,
            || {
                attempts.set(attempts.get() + 1);
                if attempts.get() == 1 {
                    Err(refused())
                } else {
                    Ok(12)
                }
            },
            || 0,
        );
        assert_eq!((got.unwrap(), attempts.get()), (12, 2));
    }

    #[test]
    fn a_failed_synchronisation_is_returned() {
        let got = synchronized_bound(
            || 0,
            || {
                Err(DriverError::Cuda {
                    code: 700,
                    operation: "cuCtxSynchronize",
                })
            },
            || 0,
        );
        assert!(matches!(got, Err(DriverError::Cuda { code: 700, .. })));
    }
}

/// While a capture on a blocking stream is recorded, its context's legacy default stream is
/// refused (blocking copies through `refuse_legacy_stream_use`, `Stream::legacy_default`
/// through `refuse_on_legacy_stream`); other contexts, other streams, and contexts where only
/// non-blocking streams capture are not. The registry is filled by hand: no driver is asked.
#[test]
fn the_legacy_stream_is_refused_only_beside_a_blocking_capture_of_its_context() {
    use std::sync::Arc;

    use super::registry::{BLOCKING, RECORDS, Record};
    use crate::{Context, Device, DriverError, GraphError, Stream};

    // Holds off the failure-log tests, which read the records' first failures.
    let _count = CAPTURE_COUNT_TEST_LOCK.lock();
    // SAFETY: none of these handles reaches the driver: the streams below are not owned (their
    // drop calls nothing), and the checks only compare raw values with the records.
    let context = |raw: usize| unsafe {
        Context::from_raw_borrowed(raw as sys::CUcontext, Device::for_tests(0))
    };
    let (blocking_ctx, non_blocking_ctx, idle_ctx) = (
        context(0xb10c_0000),
        context(0xb10c_1000),
        context(0xb10c_2000),
    );
    let record = |stream: u64, context: &Arc<Context>, blocking: bool| Record {
        stream,
        mode: CaptureMode::ThreadLocal,
        first_failure: u64::MAX,
        capture_id: u64::MAX - stream,
        context: context.as_raw() as usize,
        complete_before: 0,
        thread: std::thread::current().id(),
        tracked: false,
        blocking,
    };
    let refused = |result: crate::error::Result<()>, operation: &str| match result {
        Err(DriverError::Graph(GraphError::Capturing {
            operation: named, ..
        })) => {
            assert_eq!(named, operation);
            true
        }
        Err(other) => panic!("{other}"),
        Ok(()) => false,
    };
    let legacy = |context: &Arc<Context>| Stream::legacy_default(context);
    // SAFETY: not owned, never used with the driver (see above).
    let own = unsafe { Stream::from_raw(&blocking_ctx, 0x5000 as sys::CUstream, false) };
    // SAFETY: as above; `CU_STREAM_PER_THREAD` is not the legacy stream.
    let per_thread = unsafe { Stream::from_raw(&blocking_ctx, 2 as sys::CUstream, false) };
    // SAFETY: as above; `CU_STREAM_LEGACY` is.
    let legacy_name = unsafe { Stream::from_raw(&blocking_ctx, 1 as sys::CUstream, false) };

    // Nothing captures on a blocking stream: nothing is refused, for one atomic load.
    assert_eq!(BLOCKING.load(Ordering::Acquire), 0);
    assert!(!refused(
        refuse_legacy_stream_use(&blocking_ctx, "memory::copy_htod"),
        ""
    ));
    assert!(!refused(
        refuse_on_legacy_stream(&legacy(&blocking_ctx), "Event::record"),
        ""
    ));

    {
        let mut records = RECORDS.lock();
        records.push(record(u64::MAX - 1, &blocking_ctx, true));
        records.push(record(u64::MAX - 2, &non_blocking_ctx, false));
    }
    BLOCKING.fetch_add(1, Ordering::AcqRel);
    let outcomes = [
        refused(
            refuse_legacy_stream_use(&blocking_ctx, "memory::copy_htod"),
            "memory::copy_htod",
        ),
        refused(
            refuse_on_legacy_stream(&legacy(&blocking_ctx), "Kernel::launch"),
            "Kernel::launch",
        ),
        refused(
            refuse_on_legacy_stream(&legacy_name, "Event::record"),
            "Event::record",
        ),
        // Other streams of that context, and other contexts, are left alone.
        refused(refuse_on_legacy_stream(&own, "Kernel::launch"), ""),
        refused(refuse_on_legacy_stream(&per_thread, "Kernel::launch"), ""),
        refused(
            refuse_legacy_stream_use(&non_blocking_ctx, "memory::memset_d32"),
            "",
        ),
        refused(
            refuse_on_legacy_stream(&legacy(&idle_ctx), "Stream::synchronize"),
            "",
        ),
    ];
    // The capture ends: nothing is refused any more.
    RECORDS
        .lock()
        .retain(|record| record.stream != u64::MAX - 1 && record.stream != u64::MAX - 2);
    BLOCKING.fetch_sub(1, Ordering::AcqRel);
    let after = refused(
        refuse_legacy_stream_use(&blocking_ctx, "memory::copy_htod"),
        "",
    );
    assert_eq!(
        (outcomes, after),
        ([true, true, true, false, false, false, false], false)
    );
}

#[test]
fn a_wait_for_no_global_capture_is_woken_by_the_capture_end_and_times_out_otherwise() {
    use super::registry::{GLOBAL, signal_capture_end};
    use std::time::Duration;
    let _count = CAPTURE_COUNT_TEST_LOCK.lock();
    assert!(
        wait_for_no_global_capture(Duration::ZERO),
        "none active: at once"
    );
    GLOBAL.fetch_add(1, Ordering::AcqRel);
    assert!(
        !wait_for_no_global_capture(Duration::from_millis(5)),
        "a global capture outlives a short wait"
    );
    let (started, ready) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        started.send(()).unwrap();
        wait_for_no_global_capture(Duration::from_secs(60))
    });
    ready.recv().unwrap();
    // The end, as `forget_capture` makes it: the count down, then the signal.
    GLOBAL.fetch_sub(1, Ordering::AcqRel);
    signal_capture_end();
    assert!(
        waiter.join().unwrap(),
        "woken by the end, well before its limit"
    );
}
