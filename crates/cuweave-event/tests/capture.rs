//! GPU tests of waits beside stream captures: a global-mode capture on another thread does not
//! fail pending waits, and a wait on a capturing stream is refused with a typed error.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use common::{Flags, MS, within};
use cuweave_driver::{CaptureMode, DriverError, GraphError};
use cuweave_event::{
    AsyncEventWaiter, EventError, EventPool, OperationCoordinator, OperationState, WaitOptions,
    WakeMechanism,
};
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::{require_gpu, serial};
use rstest::rstest;

#[test]
fn waits_resolve_while_another_thread_runs_a_global_mode_capture() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = Arc::new(TestKernels::load(&gpu.context).unwrap());
    let waiter = Arc::new(AsyncEventWaiter::new().unwrap());
    let pool = EventPool::new(&gpu.context, 4, 4).unwrap();
    let coordinator = OperationCoordinator::with_waiter(pool.clone(), Arc::clone(&waiter));
    let (work, capturing) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let flags = Arc::new(Flags::new(&gpu.context, 1));
    // Warm up outside the capture: the completion-word slab, its probe stream and a
    // blocking-sync event exist before it begins, so the waits below make no call that a
    // capture forbids on this thread.
    futures::executor::block_on(waiter.stream_idle(&work).unwrap()).unwrap();
    let op = common::register_kernel(&coordinator, &[], "spin");

    // Thread B: a global-mode capture, held until told to end it.
    let (began_tx, began_rx) = mpsc::channel();
    let (end_tx, end_rx) = mpsc::channel::<()>();
    let capture = std::thread::spawn({
        let (kernels, capturing) = (Arc::clone(&kernels), Arc::clone(&capturing));
        move || {
            capturing.begin_capture(CaptureMode::Global).unwrap();
            kernels.spin_ns(&capturing, 1000).unwrap();
            began_tx.send(()).unwrap();
            end_rx.recv().unwrap();
            capturing.end_capture().and_then(|graph| graph.node_count())
        }
    });
    began_rx.recv().unwrap();

    // Thread A (this one): a kernel that spins 50 ms, then sets the flag; waits behind it.
    coordinator.begin_operation(op, &work).unwrap();
    // SAFETY: the flag is mapped pinned memory of this context, alive until the stream is done.
    unsafe {
        kernels
            .spin_then_store_u32(&work, 50 * MS, flags.device(0), 1)
            .unwrap()
    };
    coordinator.complete_operation(op).unwrap();
    let event = Arc::new(pool.acquire_owned(false).unwrap());
    event.record(&work).unwrap();
    let event_wait = waiter.event_done(Arc::clone(&event));
    let idle_wait = waiter.stream_idle(&work).unwrap();
    assert_eq!(
        flags.read(0),
        0,
        "the spin ended before the waits were made"
    );
    let (event_result, idle_result, flag) = within(Duration::from_secs(10), {
        let flags = Arc::clone(&flags);
        move || {
            let event_result = futures::executor::block_on(event_wait);
            let idle_result = futures::executor::block_on(idle_wait);
            (event_result, idle_result, flags.read(0))
        }
    });
    // This thread's own queries are still refused while the capture runs: "not yet", not
    // "failed".
    let state_during = coordinator.state(op).unwrap();
    end_tx.send(()).unwrap();
    let graph = capture.join().unwrap();

    assert_eq!(
        event_result,
        Ok(()),
        "the event wait failed during the capture"
    );
    assert_eq!(
        idle_result,
        Ok(()),
        "the stream wait failed during the capture"
    );
    assert_eq!(flag, 1, "a wait resolved before the kernel finished");
    assert_eq!(state_during, OperationState::Queued);
    assert_eq!(graph, Ok(1), "the waits broke the other thread's capture");
    assert_eq!(coordinator.state(op).unwrap(), OperationState::Completed);
    assert_eq!(coordinator.metrics().failed, 0);
    let stats = waiter.stats();
    assert_eq!((stats.failed, stats.pending), (0, 0));
}

#[rstest]
fn a_wait_on_a_capturing_stream_is_refused_and_leaves_nothing_behind(
    #[values(
        WakeMechanism::CompletionWord,
        WakeMechanism::EventQuery,
        WakeMechanism::HostFunction
    )]
    mechanism: WakeMechanism,
) {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let stream = common::stream(&gpu.context);
    // The slab and its words exist before the capture.
    futures::executor::block_on(waiter.stream_idle(&stream).unwrap()).unwrap();
    let before = waiter.stats();

    stream.begin_capture(CaptureMode::ThreadLocal).unwrap();
    kernels.spin_ns(&stream, 1000).unwrap();
    let idle = waiter.stream_idle_with(&stream, WaitOptions::new(mechanism));
    let ran = Arc::new(AtomicBool::new(false));
    let callback = waiter.wait_stream_async(&stream, {
        let ran = Arc::clone(&ran);
        move |_| ran.store(true, Ordering::SeqCst)
    });
    let graph = stream.end_capture().unwrap();

    let idle_error = idle.expect_err("a wait on a capturing stream was accepted");
    assert!(idle_error.is_capture_refusal(), "{idle_error:?}");
    let callback_error = callback.expect_err("a callback on a capturing stream was accepted");
    assert!(callback_error.is_capture_refusal(), "{callback_error:?}");
    // Nothing was recorded into the capture but the kernel, and nothing was registered.
    assert_eq!(graph.node_count().unwrap(), 1);
    let after = waiter.stats();
    assert_eq!(after.registered, before.registered);
    assert_eq!(after.pending, 0, "a wait was left behind");
    assert!(!ran.load(Ordering::SeqCst));
    // Once the capture ended the stream is waited on as usual.
    let result = within(Duration::from_secs(5), {
        let future = waiter
            .stream_idle_with(&stream, WaitOptions::new(mechanism))
            .unwrap();
        move || futures::executor::block_on(future)
    });
    assert_eq!(result, Ok(()));
    assert_eq!(waiter.pending(), 0);
}

#[test]
fn capture_refusals_are_recognised_through_the_driver_and_stream_layers() {
    let refusal = || {
        DriverError::from(GraphError::Capturing {
            operation: "op",
            reason: "capturing",
        })
    };
    assert!(EventError::from(refusal()).is_capture_refusal());
    assert!(EventError::from(cuweave_stream::StreamError::from(refusal())).is_capture_refusal());
    assert!(!EventError::from(DriverError::from(GraphError::UnjoinedFork)).is_capture_refusal());
    assert!(
        !EventError::from(DriverError::NotFound {
            searched: String::new(),
            reason: String::new()
        })
        .is_capture_refusal()
    );
}

/// An operation begun on a capturing stream with a dependency that ran eagerly: refused while
/// the dependency may still run (the wait would invalidate the capture), accepted without a
/// wait once a synchronised begin has proved it finished.
#[test]
fn a_capturing_stream_refuses_an_eager_dependency_unless_its_begin_proved_it_finished() {
    let gpu = require_gpu!();
    let _serial = serial();
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 4, 4).unwrap();
    let coordinator = OperationCoordinator::new(pool).unwrap();
    let (eager, capturing) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let eager_spin = |what| {
        let op = common::register_kernel(&coordinator, &[], what);
        coordinator.begin_operation(op, &eager).unwrap();
        kernels.spin_ns(&eager, 100 * MS).unwrap();
        coordinator.complete_operation(op).unwrap();
        op
    };
    let dependant = |dependency, what| common::register_kernel(&coordinator, &[dependency], what);

    // A capture begun without synchronising: the eager spin may still run.
    let running = eager_spin("eager spin");
    capturing.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let refused_op = dependant(running, "refused");
    let refused = coordinator
        .begin_operation(refused_op, &capturing)
        .expect_err("a wait across the capture's boundary was queued");
    assert!(refused.is_capture_refusal(), "{refused}");
    assert_eq!(
        coordinator.state(refused_op).unwrap(),
        OperationState::Registered
    );
    kernels.spin_ns(&capturing, 1000).unwrap();
    let graph = capturing
        .end_capture()
        .expect("the refused begin left the capture valid");
    assert_eq!(graph.node_count().unwrap(), 1, "nothing but the kernel");

    // A synchronised begin waits for the context first: the eager spin has finished, so the
    // dependant begins on the capturing stream with no wait to queue.
    let finished = eager_spin("eager spin, finished by the begin");
    capturing
        .begin_capture_synchronized(CaptureMode::ThreadLocal)
        .unwrap();
    let accepted = dependant(finished, "accepted");
    coordinator.begin_operation(accepted, &capturing).unwrap();
    assert_eq!(
        coordinator.metadata(accepted).unwrap().cross_stream_waits,
        0
    );
    kernels.spin_ns(&capturing, 1000).unwrap();
    let graph = capturing
        .end_capture()
        .expect("the accepted begin left the capture valid");
    let exec = graph
        .instantiate(&cuweave_driver::InstantiateOptions::default())
        .unwrap();
    exec.launch(&capturing).unwrap();
    capturing.synchronize().unwrap();
    // The refused operation begins once no capture is active, waiting on the device as usual.
    coordinator.begin_operation(refused_op, &capturing).unwrap();
    coordinator.complete_operation(refused_op).unwrap();
    coordinator.synchronize(refused_op).unwrap();
    assert_eq!(
        coordinator.state(refused_op).unwrap(),
        OperationState::Completed
    );
}

/// Operations recorded into a capture across two streams (a fork and a join inside the graph):
/// the coordinator decides them from their capture, never by querying their completion events
/// (the driver refuses that, `CUDA_ERROR_CAPTURED_EVENT`, during the capture and after it).
/// While the capture records they stay queued and host waits are refused; once it ends they
/// complete, their callbacks run once with `Ok`, they retire, and eager work queued behind
/// them on the same stream completes and retires too. The graph keeps the order: filled, then
/// incremented on the other stream, then incremented again.
#[test]
fn captured_operations_complete_when_their_capture_ends_and_keep_their_order_in_the_graph() {
    let gpu = require_gpu!();
    let _serial = serial();
    const N: usize = 4096;
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let pool = EventPool::new(&gpu.context, 4, 4).unwrap();
    let coordinator = OperationCoordinator::new(pool).unwrap();
    coordinator.set_timing(true);
    let (origin, side) = (common::stream(&gpu.context), common::stream(&gpu.context));
    let data = cuweave_driver::memory::DeviceAllocation::new(&gpu.context, N * 4).unwrap();
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));

    origin.begin_capture(CaptureMode::ThreadLocal).unwrap();
    let fill = common::register_kernel(&coordinator, &[], "fill with 7 after a spin");
    coordinator.begin_operation(fill, &origin).unwrap();
    kernels.spin_ns(&origin, 30 * MS).unwrap();
    // SAFETY: `data` is a live allocation of this context sized for N; the host reads it only
    // after the graph's launch has been synchronised.
    unsafe { kernels.fill_u32(&origin, data.ptr(), 7, N).unwrap() };
    coordinator.complete_operation(fill).unwrap();
    let counted = Arc::clone(&calls);
    coordinator
        .on_complete(fill, move |id, result| {
            assert_eq!((id, result), (fill, Ok(())));
            counted.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();

    // Polls during the capture leave it queued and fail nothing.
    coordinator.retire_finished();
    assert_eq!(coordinator.state(fill).unwrap(), OperationState::Queued);
    let refused = coordinator
        .synchronize(fill)
        .expect_err("a host wait for captured work was accepted");
    assert!(refused.is_capture_refusal(), "{refused}");
    assert!(coordinator.completion(fill).is_err());

    // The side stream joins the capture by waiting for `fill`, and `origin` joins it back.
    let bump = common::register_kernel(&coordinator, &[fill], "increment on the side");
    coordinator.begin_operation(bump, &side).unwrap();
    assert_eq!(coordinator.metadata(bump).unwrap().cross_stream_waits, 1);
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&side, data.ptr(), N).unwrap() };
    coordinator.complete_operation(bump).unwrap();
    coordinator.retire_finished();
    let again = common::register_kernel(&coordinator, &[bump], "increment back on origin");
    coordinator.begin_operation(again, &origin).unwrap();
    // SAFETY: as above.
    unsafe { kernels.increment_u32(&origin, data.ptr(), N).unwrap() };
    coordinator.complete_operation(again).unwrap();
    let graph = origin
        .end_capture()
        .expect("the fork and join kept the capture valid");
    assert_eq!(calls.load(Ordering::SeqCst), 0, "ran during the capture");

    // The capture ended: every captured operation is complete, ran its callback once, retired.
    for op in [fill, bump, again] {
        assert_eq!(coordinator.state(op).unwrap(), OperationState::Completed);
        coordinator.synchronize(op).unwrap();
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(coordinator.live_operations(), 0);

    // The graph runs in order, and eager work behind the captured operations on `origin`
    // completes and retires.
    let exec = graph
        .instantiate(&cuweave_driver::InstantiateOptions::default())
        .unwrap();
    let after = common::register_kernel(&coordinator, &[again], "eager, after the graph");
    exec.launch(&origin).unwrap();
    coordinator.begin_operation(after, &origin).unwrap();
    kernels.spin_ns(&origin, 1000).unwrap();
    coordinator.complete_operation(after).unwrap();
    coordinator.synchronize(after).unwrap();
    assert_eq!(coordinator.state(after).unwrap(), OperationState::Completed);
    assert_eq!(coordinator.live_operations(), 0);
    let mut bytes = vec![0u8; N * 4];
    // SAFETY: `bytes` holds N u32s; the launch finished (`after` follows it on `origin`).
    unsafe {
        cuweave_driver::memory::copy_dtoh(&gpu.context, bytes.as_mut_ptr(), data.ptr(), N * 4)
            .unwrap()
    };
    let values: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|word| u32::from_ne_bytes(word.try_into().unwrap()))
        .collect();
    assert!(values.iter().all(|&v| v == 9), "{:?}", &values[..8]);
}
