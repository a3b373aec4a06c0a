//! [`BufferCore`], the untyped part every buffer holds, and [`CoreRef`], the borrowed view of
//! it (or of part of it) that the shared implementation of [`Buffer`](super::Buffer) works on.

use std::sync::Arc;

use cuweave_driver::Context;
use cuweave_driver::memory::DevicePtr;

use super::super::range::DeviceSpan;
use super::super::tracker::{Part, StreamTracker};
use super::super::uses::ByteRange;
use crate::error::Result;

/// The untyped part every buffer holds: where its memory is, and its last use.
#[derive(Debug)]
pub struct BufferCore {
    ptr: DevicePtr,
    len: usize,
    element_size: usize,
    tracker: StreamTracker,
}

impl BufferCore {
    /// A core for `len` elements of `element_size` bytes at device address `ptr`, whose
    /// tracker takes its events from the context's event pool.
    ///
    /// # Errors
    /// As [`EventPool::for_context`](cuweave_driver::EventPool::for_context).
    pub(crate) fn new(
        context: &Arc<Context>,
        ptr: DevicePtr,
        len: usize,
        element_size: usize,
    ) -> Result<Self> {
        Ok(Self::with_tracker(
            StreamTracker::new(context)?,
            ptr,
            len,
            element_size,
        ))
    }

    /// A core whose uses `tracker` records.
    #[inline]
    pub(crate) fn with_tracker(
        tracker: StreamTracker,
        ptr: DevicePtr,
        len: usize,
        element_size: usize,
    ) -> Self {
        Self {
            ptr,
            len,
            element_size,
            tracker,
        }
    }

    /// The context the memory belongs to.
    #[inline]
    pub(crate) fn context(&self) -> &Arc<Context> {
        self.tracker.context()
    }

    /// Length in elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.len * self.element_size
    }

    /// The buffer's tracker, exclusively (while dropping).
    #[inline]
    pub(crate) fn tracker_mut(&mut self) -> &mut StreamTracker {
        &mut self.tracker
    }

    /// The buffer's last-use tracker.
    pub(crate) fn tracker(&self) -> &StreamTracker {
        &self.tracker
    }

    /// A borrowed view of the whole buffer, writable.
    #[inline]
    pub(crate) fn as_ref(&self) -> CoreRef<'_> {
        CoreRef {
            tracker: &self.tracker,
            ptr: &self.ptr,
            len: self.len,
            element_size: self.element_size,
            offset: 0,
            writable: true,
        }
    }
}

/// What the shared implementation sees of a buffer or of a view of one: where the elements
/// are, the tracker of the buffer they belong to, and which bytes of it they are.
#[derive(Debug, Clone, Copy)]
pub struct CoreRef<'a> {
    tracker: &'a StreamTracker,
    ptr: &'a DevicePtr,
    len: usize,
    element_size: usize,
    /// Bytes from the buffer's first byte to this part's.
    offset: usize,
    writable: bool,
}

impl<'a> CoreRef<'a> {
    /// A view of `len` elements at element `start` of this part (already range-checked).
    pub(crate) fn sub(self, ptr: &'a DevicePtr, start: usize, len: usize, writable: bool) -> Self {
        Self {
            ptr,
            len,
            offset: self.offset + start * self.element_size,
            writable: writable && self.writable,
            ..self
        }
    }

    /// The context the memory belongs to.
    #[inline]
    pub(crate) fn context(self) -> &'a Arc<Context> {
        self.tracker.context()
    }

    /// The device address of element 0.
    #[inline]
    pub(crate) fn ptr(self) -> DevicePtr {
        *self.ptr
    }

    /// The device address of element 0, by reference (a kernel argument borrows it).
    pub(crate) fn ptr_ref(self) -> &'a DevicePtr {
        self.ptr
    }

    /// Length in elements.
    #[inline]
    pub(crate) fn len(self) -> usize {
        self.len
    }

    /// Size of one element in bytes.
    pub(crate) fn element_size(self) -> usize {
        self.element_size
    }

    /// Size in bytes.
    #[inline]
    pub(crate) fn bytes(self) -> usize {
        self.len * self.element_size
    }

    /// The buffer's tracker (for whole-buffer host waits).
    #[inline]
    pub(crate) fn tracker(self) -> &'a StreamTracker {
        self.tracker
    }

    /// This part's bytes, for tracking.
    #[inline]
    pub(crate) fn part(self) -> Part<'a> {
        Part {
            tracker: self.tracker,
            range: ByteRange::new(self.offset, self.bytes()),
            writable: self.writable,
        }
    }

    /// Elements `offset..offset + len` of this part, for tracking (the caller checked them).
    #[inline]
    pub(crate) fn part_of(self, span: DeviceSpan) -> Part<'a> {
        let skip = (span.ptr() - *self.ptr) as usize;
        Part {
            tracker: self.tracker,
            range: ByteRange::new(self.offset + skip, span.bytes()),
            writable: self.writable,
        }
    }

    /// The whole part as a span.
    #[inline]
    pub(crate) fn whole(self) -> DeviceSpan {
        DeviceSpan::checked(*self.ptr, self.bytes())
    }

    /// Elements `offset..offset + len`, checked.
    #[inline]
    pub(crate) fn span(
        self,
        operation: &'static str,
        offset: usize,
        len: usize,
    ) -> Result<DeviceSpan> {
        DeviceSpan::of_elements(
            operation,
            *self.ptr,
            self.len,
            self.element_size,
            offset,
            len,
        )
    }
}
