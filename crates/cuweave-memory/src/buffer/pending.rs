//! [`PendingCopy`]: an asynchronous copy in flight, owning its host side until it has finished.

use cuweave_driver::graph::{CaptureMode, CaptureModeGuard};
use cuweave_driver::memory::{Mark, StreamMarks};
use cuweave_driver::{OwnedPooledEvent, Stream};

/// An asynchronous copy queued on a stream, holding the host side (`H`) until the stream has
/// passed it.
///
/// [`wait`](Self::wait) blocks until the copy is done and hands the host side back. Dropping a
/// `PendingCopy` also waits before the host side is dropped, so host memory is never freed
/// under the copy engine; `std::mem::forget` leaks the host side (it is never freed), which is
/// safe. If waiting fails (the context is broken), the host side is leaked rather than freed.
///
/// A copy queued on a capturing stream (only pinned host sides are accepted there: see
/// [`MemoryError::NotCapturable`](crate::MemoryError::NotCapturable)) is recorded into the
/// graph, not run: [`is_captured`](Self::is_captured) says so, and `wait` hands the host side
/// back at once. The graph's memcpy node uses that pinned memory at every launch; the pinned
/// buffer's drop keeps it for the capture's graphs.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::{Buffer, DeviceBuffer, PinnedBuffer};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let mut device = DeviceBuffer::<f32>::zeroed(&context, 1024)?;
/// let staging = PinnedBuffer::from_slice(&context, &[1.0f32; 1024])?;
/// let pending = device.copy_from_host_async(staging, &stream)?;
/// // … queue more work, do host work …
/// let staging = pending.wait()?; // the copy has finished; the pinned buffer is ours again
/// # drop(staging);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
#[must_use = "dropping a PendingCopy blocks until the copy has finished; call `wait` to get the host side back"]
pub struct PendingCopy<H> {
    host: Option<H>,
    /// The event recorded behind the copy; `None` for a copy recorded into a stream capture,
    /// which ran nothing (an event recorded in a capture can never be waited for).
    done: Option<OwnedPooledEvent>,
    bytes: usize,
}

impl<H> PendingCopy<H> {
    /// Wraps a copy of `bytes` that `done` was recorded after, owning `host` until it completes.
    pub(crate) fn new(host: H, done: OwnedPooledEvent, bytes: usize) -> Self {
        Self {
            host: Some(host),
            done: Some(done),
            bytes,
        }
    }

    /// Wraps a copy of `bytes` recorded into a stream capture: nothing ran, so there is nothing
    /// to wait for. `host` is a pinned buffer whose own tracker recorded the captured use (its
    /// drop keeps the memory for the capture's graphs).
    pub(crate) fn captured(host: H, bytes: usize) -> Self {
        Self {
            host: Some(host),
            done: None,
            bytes,
        }
    }

    /// Blocks until the copy has finished and returns the host side.
    ///
    /// # Errors
    /// The driver's error if waiting fails; the host side is then leaked, not freed.
    pub fn wait(mut self) -> crate::Result<H> {
        if let Some(done) = &self.done {
            wait_for_copy(done)?;
        }
        Ok(self
            .host
            .take()
            .expect("the host side is present until wait or drop"))
    }

    /// Whether the copy has finished (then [`wait`](Self::wait) returns at once).
    pub fn is_complete(&self) -> crate::Result<bool> {
        match &self.done {
            Some(done) => Ok(done.query()?),
            None => Ok(true),
        }
    }

    /// Whether the copy was recorded into a stream capture rather than queued to run: then it
    /// runs at every launch of the graph made from the capture, [`wait`](Self::wait) returns the
    /// host side at once, and the host side's contents say nothing of the copy until a launch
    /// of the graph has finished.
    pub fn is_captured(&self) -> bool {
        self.done.is_none()
    }

    /// How many bytes the copy moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Waits for an async copy's event, in relaxed capture mode: the event was recorded behind
/// eager work (a copy recorded into a capture has none), so waiting for it breaks no capture,
/// and another thread's global-mode capture must not make the wait fail (a borrowed transfer
/// whose reactor saw the chunk land would resolve to an error), nor a drop leak its host side.
/// A capture of this thread's own stream still refuses nothing here: the event is not in it.
fn wait_for_copy(done: &OwnedPooledEvent) -> cuweave_driver::Result<()> {
    let _relaxed = CaptureModeGuard::enter(CaptureMode::Relaxed)?;
    done.synchronize()
}

impl<H> Drop for PendingCopy<H> {
    fn drop(&mut self) {
        let Some(host) = self.host.take() else { return };
        let Some(done) = &self.done else {
            // Captured: nothing ran; the host side's tracker keeps its memory for the graphs.
            drop(host);
            return;
        };
        match wait_for_copy(done) {
            Ok(()) => drop(host),
            Err(error) => {
                tracing::error!(%error, bytes = self.bytes, "waiting for an async copy failed; leaking its host memory");
                std::mem::forget(host);
            }
        }
    }
}

/// A copy queued on a stream with a [`StreamMarks`] mark behind it, holding the host side (`H`)
/// until the stream has passed the mark ([`StagedRead::copy_out_marked`](super::StagedRead::copy_out_marked),
/// [`StagedWrite::copy_in_marked`](super::StagedWrite::copy_in_marked)).
///
/// Like [`PendingCopy`], but its completion is learnt from the marks' word with atomic loads
/// instead of an event: no `cuEventRecord` per copy, and no driver call while a waiting thread
/// spins ([`StreamMarks::wait`]). [`wait`](Self::wait) hands the host side back; dropping also
/// waits first, and a failed wait leaks the host side rather than freeing it under the copy
/// engine; `std::mem::forget` leaks it, which is safe.
#[derive(Debug)]
#[must_use = "dropping a MarkedCopy blocks until the copy has finished; call `wait` to get the host side back"]
pub struct MarkedCopy<'s, H> {
    host: Option<H>,
    marks: &'s StreamMarks,
    mark: Mark,
    stream: &'s Stream,
    bytes: usize,
}

impl<'s, H> MarkedCopy<'s, H> {
    pub(crate) fn new(
        host: H,
        marks: &'s StreamMarks,
        mark: Mark,
        stream: &'s Stream,
        bytes: usize,
    ) -> Self {
        Self {
            host: Some(host),
            marks,
            mark,
            stream,
            bytes,
        }
    }

    /// Blocks until the stream has passed the copy's mark and returns the host side.
    ///
    /// # Errors
    /// The stream's error if it failed; the host side is then leaked, not freed.
    pub fn wait(mut self) -> crate::Result<H> {
        self.marks.wait(self.mark, self.stream)?;
        Ok(self
            .host
            .take()
            .expect("the host side is present until wait or drop"))
    }

    /// The mark behind the copy.
    pub fn mark(&self) -> Mark {
        self.mark
    }

    /// Whether the copy has finished (one atomic load; then [`wait`](Self::wait) returns at once).
    pub fn is_complete(&self) -> bool {
        self.marks.is_reached(self.mark)
    }

    /// How many bytes the copy moves.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl<H> Drop for MarkedCopy<'_, H> {
    fn drop(&mut self) {
        let Some(host) = self.host.take() else { return };
        match self.marks.wait(self.mark, self.stream) {
            Ok(()) => drop(host),
            Err(error) => {
                tracing::error!(%error, bytes = self.bytes, "waiting for a marked copy failed; leaking its host memory");
                std::mem::forget(host);
            }
        }
    }
}
