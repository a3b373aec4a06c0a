//! A context killed by a kernel trap resolves pending futures and callbacks with an error
//! instead of hanging them. The trap kills the context for the whole process, so this binary
//! holds this one test only.

mod common;

use std::time::Duration;

use common::{MS, within};
use cuweave_event::{AsyncEventWaiter, EventError, EventPool, WaitOptions, WakeMechanism};
use cuweave_test_support::event_kernels::EventKernels;
use cuweave_test_support::kernels::TestKernels;
use cuweave_test_support::require_gpu;

#[test]
fn futures_on_a_context_killed_by_a_trap_resolve_with_an_error() {
    let gpu = require_gpu!();
    // The dead context's completion-word page is leaked on purpose (its queued writes can never
    // be waited for, so freeing it could race them), which memcheck's leak check reports.
    if cuweave_test_support::skip_under_sanitizer(
        "futures_on_a_context_killed_by_a_trap_resolve_with_an_error",
        "a dead context's mapped words are leaked by design",
    ) {
        return;
    }
    let kernels = TestKernels::load(&gpu.context).unwrap();
    let event_kernels = EventKernels::load(&gpu.context).unwrap();
    let waiter = AsyncEventWaiter::new().unwrap();
    let pool = EventPool::new(&gpu.context, 2, 0).unwrap();
    let stream = common::stream(&gpu.context);
    kernels.spin_ns(&stream, 20 * MS).unwrap();
    event_kernels.trap_now(&stream).unwrap();
    let word = waiter.stream_idle(&stream).unwrap();
    let query = waiter
        .stream_idle_with(&stream, WaitOptions::new(WakeMechanism::EventQuery))
        .unwrap();
    let event = pool.acquire_owned(false).unwrap();
    event.record(&stream).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    waiter.wait_async(event, move |result| tx.send(result).unwrap());

    let (word, query) = within(Duration::from_secs(10), move || {
        (
            futures::executor::block_on(word),
            futures::executor::block_on(query),
        )
    });
    eprintln!("completion word: {word:?}\nevent query: {query:?}");
    assert!(matches!(word, Err(EventError::Driver(_))), "{word:?}");
    assert!(matches!(query, Err(EventError::Driver(_))), "{query:?}");
    let told = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert!(matches!(told, Err(EventError::Driver(_))), "{told:?}");
    assert!(waiter.stats().failed >= 3);
}
