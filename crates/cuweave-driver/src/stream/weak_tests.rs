//! Unit tests of weak stream handles that need no GPU: handles of fake streams that never reach
//! the driver (the downgraded ones are retired by hand and forgotten, since a real drop would
//! record their end).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use super::super::Stream;
use crate::context::Context;
use crate::device::Device;
use crate::sys;

/// A context handle that is never used with the driver.
fn fake_context() -> Arc<Context> {
    // SAFETY: nothing made from it reaches the driver (see the module docs).
    unsafe { Context::from_raw_borrowed(0x1000 as sys::CUcontext, Device::for_tests(0)) }
}

/// A handle of a fake stream; `owned` handles must be forgotten, never dropped.
fn fake_stream(context: &Arc<Context>, raw: usize, owned: bool) -> Stream {
    // SAFETY: never used with the driver: the tests retire downgraded handles by hand and
    // forget them (and every owned one) instead of dropping them.
    unsafe { Stream::from_raw(context, raw as sys::CUstream, owned) }
}

/// Marks `stream`'s weak handles' handle gone, as its drop would (without recording an end),
/// and forgets it.
fn retire_and_forget(stream: Stream) {
    drop(stream.retire_weak());
    std::mem::forget(stream);
}

#[test]
fn context_relative_handles_have_no_weak_handle() {
    let context = fake_context();
    assert!(Stream::legacy_default(&context).downgrade().is_none());
    assert!(fake_stream(&context, 1, false).downgrade().is_none());
    assert!(fake_stream(&context, 2, false).downgrade().is_none());
    assert!(!Stream::legacy_default(&context).is_borrowed());
}

#[test]
fn a_weak_handle_lends_a_twin_while_its_handle_lives_and_nothing_after() {
    let context = fake_context();
    let stream = fake_stream(&context, 0x4000, false);
    assert!(stream.is_borrowed());
    let weak = stream.downgrade().expect("a borrowed handle downgrades");
    assert_eq!(weak.id(), stream.id());
    assert!(weak.is_alive());
    let seen = weak.with(|twin| {
        let again = twin
            .downgrade()
            .expect("the twin lends its handle's weak handle");
        (
            twin.id(),
            twin.as_raw() as usize,
            twin.owns_its_stream(),
            twin.is_borrowed(),
            Arc::ptr_eq(&again.shared, &weak.shared),
        )
    });
    assert_eq!(seen, Some((stream.id(), 0x4000, false, true, true)));
    let clone = stream.downgrade().expect("again");
    assert!(
        Arc::ptr_eq(&clone.shared, &weak.shared),
        "one state per handle"
    );
    assert!(!weak.end().is_dropped());

    retire_and_forget(stream);
    assert!(!weak.is_alive());
    assert_eq!(
        weak.with(|_| ()),
        None,
        "the closure does not run once retired"
    );
    assert!(
        weak.end().is_dropped(),
        "whoever finds it gone finds its end set"
    );
    assert!(!weak.end().is_recorded(), "no event was recorded by hand");
}

#[test]
fn an_owning_handles_weak_handle_shares_its_watched_end_and_keys_as_it_does() {
    let context = fake_context();
    let stream = fake_stream(&context, 0x5000, true);
    assert!(!stream.is_borrowed());
    let weak = stream.downgrade().expect("an owning handle downgrades");
    let watched = stream.end_watch().expect("an owning handle is watched");
    assert!(Arc::ptr_eq(weak.end(), &watched));
    assert_eq!(
        weak.with(|twin| (twin.owns_its_stream(), twin.is_borrowed(), twin.id())),
        Some((false, false, stream.id())),
        "the twin destroys nothing, but is keyed as its owning handle"
    );
    retire_and_forget(stream);
    assert!(watched.is_dropped());
}

#[test]
fn retiring_waits_for_the_closures_running_and_none_starts_after() {
    let context = fake_context();
    let stream = fake_stream(&context, 0x6000, false);
    let weak = stream.downgrade().expect("weak");
    let started = Barrier::new(2);
    let finished = AtomicBool::new(false);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            weak.with(|_| {
                started.wait();
                std::thread::sleep(Duration::from_millis(50));
                finished.store(true, Ordering::SeqCst);
            })
            .expect("alive when it began");
        });
        started.wait();
        let retiring = stream.retire_weak().expect("downgraded");
        assert!(
            finished.load(Ordering::SeqCst),
            "the drop waited for the closure"
        );
        drop(retiring);
    });
    assert!(weak.with(|_| ()).is_none());
    std::mem::forget(stream);
}

#[test]
fn a_closure_may_reach_the_weak_handle_again() {
    let context = fake_context();
    let stream = fake_stream(&context, 0x7000, false);
    let weak = stream.downgrade().expect("weak");
    let nested = weak.with(|twin| {
        let again = twin.downgrade().expect("weak again");
        again.with(|inner| inner.id())
    });
    assert_eq!(nested, Some(Some(stream.id())));
    retire_and_forget(stream);
}
