//! [`WatchedEvent`]: anything holding an [`Event`] that the reactor can query and keep alive.

use std::sync::Arc;

use cuweave_driver::Event;

use cuweave_driver::OwnedPooledEvent;

/// An event a waiter can own while it watches it: an [`Event`], an [`OwnedPooledEvent`], or an
/// `Arc` of either (to keep using it elsewhere meanwhile).
pub trait WatchedEvent: Send + Sync + 'static {
    /// The event to query.
    fn event(&self) -> &Event;
}

impl WatchedEvent for Event {
    fn event(&self) -> &Event {
        self
    }
}

impl WatchedEvent for OwnedPooledEvent {
    fn event(&self) -> &Event {
        self
    }
}

impl<T: WatchedEvent> WatchedEvent for Arc<T> {
    fn event(&self) -> &Event {
        (**self).event()
    }
}
