//! [`Handoff`]: how a staging worker hands a value (pinned blocks, a finished transfer) to the
//! future waiting for it.

use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;

/// A value handed from a background job to a future, with the waker to call.
pub(super) struct Handoff<V> {
    slot: Mutex<(Option<V>, Option<Waker>)>,
}

impl<V> Handoff<V> {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            slot: Mutex::new((None, None)),
        })
    }

    pub(super) fn fill(&self, value: V) {
        let waker = {
            let mut slot = self.slot.lock();
            slot.0 = Some(value);
            slot.1.take()
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    pub(super) fn poll_take(&self, cx: &Context<'_>) -> Poll<V> {
        let mut slot = self.slot.lock();
        match slot.0.take() {
            Some(value) => Poll::Ready(value),
            None => {
                slot.1 = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}
