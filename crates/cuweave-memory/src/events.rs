//! [`ContextEvents`]: where the allocators and the pinned pool take the events they record
//! behind uses: the driver's one event pool of their context
//! ([`EventPool::for_context`](cuweave_driver::EventPool::for_context)), looked up on first use
//! and held from then on.
//!
//! No part of this crate keeps spare events of its own. An event recorded behind a use is an
//! [`OwnedPooledEvent`]: it travels with the block it guards (a caching allocator's pending
//! block, a pinned pool's returned block) and goes back to the pool when dropped, so the events
//! a context ever creates are bounded by the most that are held at once.

use std::sync::{Arc, OnceLock};

use cuweave_driver::{Context, EventPool, OwnedPooledEvent, Stream};

use crate::error::Result;

/// The event pool of one context, looked up the first time an event is needed (so that
/// building an allocator or a pinned pool makes no driver call and cannot fail).
#[derive(Debug, Default)]
pub(crate) struct ContextEvents(OnceLock<EventPool>);

impl ContextEvents {
    /// The pool of `context` (always the same context for one `ContextEvents`).
    ///
    /// # Errors
    /// As [`EventPool::for_context`].
    #[inline]
    pub(crate) fn pool(&self, context: &Arc<Context>) -> Result<&EventPool> {
        match self.0.get() {
            Some(pool) => Ok(pool),
            None => self.look_up(context),
        }
    }

    #[cold]
    fn look_up(&self, context: &Arc<Context>) -> Result<&EventPool> {
        let pool = EventPool::for_context(context)?;
        // Another thread may have stored the same context's pool meanwhile: either will do.
        Ok(self.0.get_or_init(|| pool))
    }

    /// A non-timing event to record on `stream`: from the pool of `context` when the stream
    /// is of that context, else from the pool of the stream's own context (pinned memory is
    /// portable, so streams of other contexts may use it).
    ///
    /// # Errors
    /// The driver's error when the pool had to grow and creating the event failed.
    pub(crate) fn for_stream(
        &self,
        context: &Arc<Context>,
        stream: &Stream,
    ) -> Result<OwnedPooledEvent> {
        event_on(self.pool(context)?, stream)
    }
}

/// A non-timing event to record on `stream`: from `pool` when the stream is of `pool`'s context
/// (no process-wide lookup), else from the pool of the stream's own context.
///
/// # Errors
/// The driver's error when the pool had to grow and creating the event failed.
#[inline]
pub(crate) fn event_on(pool: &EventPool, stream: &Stream) -> Result<OwnedPooledEvent> {
    let event = if stream.context().as_raw() == pool.context().as_raw() {
        pool.acquire_owned(false)?
    } else {
        EventPool::for_context(stream.context())?.acquire_owned(false)?
    };
    Ok(event)
}

/// An event recorded on a stream, with that stream's identity: two events of one stream
/// complete in the order they were recorded, so whoever polls many of them can stop at a
/// stream's first unfinished one.
#[derive(Debug)]
pub(crate) struct StreamEvent {
    /// The event, recorded behind the stream's work.
    pub(crate) event: OwnedPooledEvent,
    /// The stream's [`Stream::id`]; `None` for a default-stream handle (`CUstream` 0, 1 or 2),
    /// whose one handle can name several streams.
    pub(crate) stream: Option<u64>,
}

impl StreamEvent {
    /// `event`, just recorded on `stream`.
    #[inline]
    pub(crate) fn recorded_on(event: OwnedPooledEvent, stream: &Stream) -> Self {
        let stream = (!stream.is_special_handle()).then(|| stream.id());
        Self { event, stream }
    }
}
