//! [`ManagedRange`]: a checked byte range of one live managed allocation.

use std::sync::Arc;

use cuweave_driver::memory::DevicePtr;
use cuweave_driver::{Context, Device};

use crate::buffer::range::DeviceSpan;
use crate::buffer::tracker::StreamTracker;
use crate::buffer::{Sealed, UnifiedBuffer};
use crate::element::Element;
use crate::error::Result;

/// A nonempty range of managed memory inside one live allocation: a whole
/// [`UnifiedBuffer`], part of one, or part of a raw range given to
/// [`ManagedMemoryHints::from_raw`](super::ManagedMemoryHints::from_raw).
///
/// It borrows the buffer it came from, so the memory outlives it; prefetches of it are recorded
/// as uses of that buffer. Made by [`UnifiedBuffer::as_range`], [`UnifiedBuffer::range`],
/// [`ManagedMemoryHints::subrange`](super::ManagedMemoryHints::subrange) or `From<&UnifiedBuffer>`.
#[derive(Debug, Clone)]
pub struct ManagedRange<'a> {
    context: Arc<Context>,
    span: DeviceSpan,
    tracker: Option<&'a StreamTracker>,
}

impl<'a> ManagedRange<'a> {
    /// Crate invariant: `span` lies inside one managed allocation of `context` that outlives
    /// `'a` (and, for raw ranges, every queued prefetch of it); `tracker` is that buffer's.
    pub(crate) fn new(
        context: &Arc<Context>,
        span: DeviceSpan,
        tracker: Option<&'a StreamTracker>,
    ) -> Self {
        Self {
            context: Arc::clone(context),
            span,
            tracker,
        }
    }

    /// The start address.
    pub fn ptr(&self) -> DevicePtr {
        self.span.ptr()
    }

    /// The length in bytes (never zero).
    pub fn bytes(&self) -> usize {
        self.span.bytes()
    }

    /// The context of the allocation.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// The device of the allocation's context.
    pub fn device(&self) -> Device {
        self.context.device()
    }

    pub(crate) fn tracker(&self) -> Option<&'a StreamTracker> {
        self.tracker
    }
}

impl<'a, T: Element> From<&'a UnifiedBuffer<T>> for ManagedRange<'a> {
    fn from(buffer: &'a UnifiedBuffer<T>) -> Self {
        buffer.as_range()
    }
}

impl<T: Element> UnifiedBuffer<T> {
    /// The whole buffer as a managed range.
    pub fn as_range(&self) -> ManagedRange<'_> {
        let core = self.core();
        ManagedRange::new(core.context(), core.whole(), Some(self.tracker()))
    }

    /// Elements `offset..offset + len` as a managed range.
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0`, `OutOfRange` past the end.
    pub fn range(&self, offset: usize, len: usize) -> Result<ManagedRange<'_>> {
        let core = self.core();
        let span = core.span("UnifiedBuffer::range", offset, len)?;
        Ok(ManagedRange::new(
            core.context(),
            span,
            Some(self.tracker()),
        ))
    }
}
