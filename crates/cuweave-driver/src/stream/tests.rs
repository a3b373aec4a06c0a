//! Unit tests of stream handles that need no GPU: stream ends, and the context checks of
//! default-stream handles.

use super::*;

#[test]
fn a_stream_end_is_dropped_once_set_and_finished_only_with_an_event() {
    let end = StreamEnd::default();
    assert!(!end.is_dropped());
    assert!(!end.is_finished().unwrap());
    let before = ended_watched_streams();
    end.set(None);
    assert!(end.is_dropped());
    assert!(
        !end.is_finished().unwrap(),
        "no event recorded: never known finished"
    );
    assert!(ended_watched_streams() > before);
    let counted = ended_watched_streams();
    end.set(None);
    assert!(
        ended_watched_streams() >= counted,
        "a second end is not counted (other tests may count theirs)"
    );
}

/// A context handle that is never used with the driver (only its raw value is compared).
fn fake_context(raw: usize, ordinal: usize) -> Arc<Context> {
    // SAFETY: neither the handle nor anything made from it reaches the driver: the streams
    // below are not owned (their drop calls nothing) and only `ensure_context` runs.
    unsafe { Context::from_raw_borrowed(raw as sys::CUcontext, Device::for_tests(ordinal)) }
}

#[test]
fn a_default_stream_of_another_context_on_the_device_is_refused() {
    let primary = fake_context(0x1000, 0);
    let same_primary = fake_context(0x1000, 0);
    let other_library = fake_context(0x2000, 0);
    let legacy = Stream::legacy_default(&other_library);
    let error = legacy
        .ensure_context(&primary, "Event::record")
        .expect_err("another context's default stream would be read as this one's");
    assert!(
        matches!(error, DriverError::InvalidArgument { .. }),
        "{error}"
    );
    assert!(
        legacy
            .ensure_context(&other_library, "Event::record")
            .is_ok()
    );
    assert!(
        Stream::legacy_default(&primary)
            .ensure_context(&same_primary, "Event::record")
            .is_ok(),
        "two handles of one context are the same context"
    );
}

#[test]
fn a_created_stream_names_itself_and_is_checked_by_device_only() {
    let primary = fake_context(0x1000, 0);
    let other_library = fake_context(0x2000, 0);
    let elsewhere = fake_context(0x3000, 1);
    // SAFETY: never used with the driver; not owned, so its drop calls nothing.
    let stream = unsafe { Stream::from_raw(&other_library, 0x4000 as sys::CUstream, false) };
    assert!(stream.ensure_context(&primary, "Kernel::launch").is_ok());
    assert!(stream.ensure_context(&elsewhere, "Kernel::launch").is_err());
}
