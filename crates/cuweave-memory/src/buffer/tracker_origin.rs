//! [`Origin`]: where a cached buffer's block comes from, and the wait that orders its first use
//! on another stream after the block's earlier work.
//!
//! A caching allocator hands a block out again on the stream it was freed for, at once when its
//! last buffer recorded no use: stream order covers the reuse *on that stream*. But the rules
//! let a buffer's owner queue work on the allocation stream without recording it, so a block may
//! still have such work queued when the next buffer gets it; if that buffer is then used on
//! another stream, nothing orders the new use after the old work, and the old work overwrites
//! it (an H200 probe: a 300 ms late write of the dropped buffer landed after the next buffer's
//! fill on another stream).
//!
//! So a cached buffer remembers its allocation stream (a [`WeakStream`], or the context's
//! legacy stream for `DeviceBuffer::new`) and the capture epoch of its allocation, and the first
//! use on another stream, before it waits for anything else, makes that stream wait for where
//! the allocation stream stands then (`Stream::wait_stream`: one pooled event recorded and
//! waited for), or, when the allocation stream's handle is gone, for the end its drop recorded.
//! After that the buffer's own tracked uses order everything. Uses on the allocation stream
//! need no wait, so the hot path (allocate, use on one stream, drop) records no event.
//!
//! While a capture is involved nothing is waited for that could break it: a capturing stream is
//! ordered after the old work only when its capture began with the context synchronised after
//! the allocation (the epoch says so; that is `StreamCapture` and
//! `begin_capture_synchronized`); a capturing allocation stream, or the legacy stream while any
//! capture is active, is not waited on, and the origin stays pending for the next eager use.

use std::sync::Arc;

use cuweave_driver::stream::WeakStream;
use cuweave_driver::{Context, Stream};

use super::super::raw::legacy_stream;
use super::super::uses::CaptureView;
use crate::error::Result;

/// The stream a cached buffer's memory was allocated for, until a use on another stream has
/// been ordered after it.
#[derive(Debug)]
pub(crate) struct Origin {
    home: Home,
    /// The capture epoch read after the allocation.
    epoch: u64,
}

/// Where the block's earlier work may still be queued.
#[derive(Debug)]
enum Home {
    /// A created or borrowed stream, reached while its handle lives.
    Stream(WeakStream),
    /// The legacy default stream of the buffer's context.
    Legacy,
}

/// What the first use on `stream` must do about the origin (the pure part of
/// [`Origin::order`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Nothing now; the origin stays pending (a use on the allocation stream itself, or a wait
    /// that could break a capture).
    Keep,
    /// The old work is known to be done: forget the origin.
    Settled,
    /// Make the stream wait for the allocation stream, then forget the origin.
    Wait,
}

/// The plan for a use on a stream that `is_home` says is (or is not) the allocation stream,
/// seen through `view`, of a block allocated at capture epoch `epoch`; `legacy_home` when the
/// allocation stream is the legacy default stream.
fn plan(is_home: bool, legacy_home: bool, epoch: u64, view: &CaptureView) -> Plan {
    if is_home {
        return Plan::Keep;
    }
    match view.capture {
        // A capturing stream cannot wait for eager work: the old work is covered only when the
        // capture began with the context synchronised after the allocation.
        Some(capturing) if epoch < capturing.complete_before => Plan::Settled,
        Some(_) => Plan::Keep,
        // Legacy-stream work while a capture is active could invalidate it.
        None if legacy_home && view.any_active => Plan::Keep,
        None => Plan::Wait,
    }
}

impl Origin {
    /// The origin of memory just allocated for `stream` (a context-relative handle stands for
    /// the legacy stream: the per-thread one never keys a cached block).
    #[inline]
    pub(crate) fn of(stream: &Stream) -> Self {
        let home = match stream.downgrade() {
            Some(weak) => Home::Stream(weak),
            None => Home::Legacy,
        };
        Self {
            home,
            epoch: cuweave_driver::graph::capture_state().epoch,
        }
    }

    fn is_home(&self, context: &Context, stream: &Stream) -> bool {
        match &self.home {
            Home::Stream(home) => home.id() == stream.id(),
            Home::Legacy => {
                matches!(stream.as_raw() as usize, 0 | 1)
                    && stream.context().as_raw() == context.as_raw()
            }
        }
    }

    /// Orders a use on `stream` after the block's earlier work on the allocation stream, when
    /// it needs to be and can be: `true` once that is done (or known unnecessary), so the
    /// origin can be forgotten; `false` keeps it pending.
    ///
    /// # Errors
    /// The driver's error from recording or waiting (a wait refused across a capture boundary
    /// included); nothing was ordered.
    #[cold]
    #[inline(never)]
    pub(crate) fn order(
        &self,
        context: &Arc<Context>,
        stream: &Stream,
        view: &CaptureView,
    ) -> Result<bool> {
        let legacy_home = matches!(self.home, Home::Legacy);
        match plan(self.is_home(context, stream), legacy_home, self.epoch, view) {
            Plan::Keep => Ok(false),
            Plan::Settled => Ok(true),
            Plan::Wait => match &self.home {
                Home::Legacy => {
                    stream.wait_stream(&legacy_stream(context))?;
                    Ok(true)
                }
                Home::Stream(home) => order_after_home(home, context, stream, view),
            },
        }
    }
}

/// Makes `stream` wait for `home` while its handle lives, else for the end its drop recorded.
fn order_after_home(
    home: &WeakStream,
    context: &Arc<Context>,
    stream: &Stream,
    view: &CaptureView,
) -> Result<bool> {
    let waited = home.with(|home| -> Result<bool> {
        // Also captures begun outside cuweave: waiting on a capturing stream would fork this
        // one into its capture.
        if home.is_capturing()? {
            return Ok(false);
        }
        stream.wait_stream(home)?;
        Ok(true)
    });
    if let Some(waited) = waited {
        return waited;
    }
    if home.end().wait_on(stream)? {
        return Ok(true);
    }
    // The handle dropped without an end event (the driver failed): only the device's end is
    // known to cover its work.
    if view.any_active {
        return Ok(false);
    }
    context.synchronize()?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::super::super::uses::{CaptureView, Capturing};
    use super::{Plan, plan};

    const EAGER: CaptureView = CaptureView::NONE;
    const BESIDE_A_CAPTURE: CaptureView = CaptureView {
        any_active: true,
        capture: None,
    };

    fn capturing(complete_before: u64) -> CaptureView {
        CaptureView {
            any_active: true,
            capture: Some(Capturing {
                id: 7,
                complete_before,
            }),
        }
    }

    #[rstest]
    // The allocation stream itself: stream order covers the old work; the origin stays for
    // the first use elsewhere.
    #[case::home(true, false, 5, EAGER, Plan::Keep)]
    #[case::legacy_home(true, true, 5, BESIDE_A_CAPTURE, Plan::Keep)]
    // Another eager stream waits, then the origin is forgotten.
    #[case::elsewhere(false, false, 5, EAGER, Plan::Wait)]
    #[case::legacy_elsewhere(false, true, 5, EAGER, Plan::Wait)]
    #[case::elsewhere_beside_a_capture(false, false, 5, BESIDE_A_CAPTURE, Plan::Wait)]
    // Legacy-stream work while a capture is active could break it: later.
    #[case::legacy_beside_a_capture(false, true, 5, BESIDE_A_CAPTURE, Plan::Keep)]
    // A capture that began with the context synchronised after the allocation covers it.
    #[case::synchronised_capture(false, false, 5, capturing(6), Plan::Settled)]
    #[case::synchronised_capture_legacy(false, true, 5, capturing(6), Plan::Settled)]
    // One that did not cannot wait for eager work: the origin waits for an eager use.
    #[case::capture_without_synchronisation(false, false, 5, capturing(0), Plan::Keep)]
    #[case::capture_after_allocation_only(false, false, 5, capturing(5), Plan::Keep)]
    fn the_first_use_elsewhere_waits_only_where_it_may(
        #[case] is_home: bool,
        #[case] legacy_home: bool,
        #[case] epoch: u64,
        #[case] view: CaptureView,
        #[case] expected: Plan,
    ) {
        assert_eq!(plan(is_home, legacy_home, epoch, &view), expected);
    }
}
