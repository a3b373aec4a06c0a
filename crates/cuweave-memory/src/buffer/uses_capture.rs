//! The capture side of the bookkeeping: where an operation's stream stands ([`CaptureView`]),
//! which captures used which bytes of the buffer (so that eager work and the launches of their
//! graphs are ordered where they conflict), and the graph pools those captures were bound to.

use super::super::tracker::Access;
use super::{ByteRange, CAPTURES_KEPT, NO_POOL, PRUNE_GRAPHS_AT, UseEvent, UseState, UseStream};

/// Where an operation's stream stands with respect to capture, read once per operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct CaptureView {
    /// Whether any capture is active in the process.
    pub(crate) any_active: bool,
    /// The capture the stream records into, when it is capturing.
    pub(crate) capture: Option<Capturing>,
}

/// The capture a stream records into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Capturing {
    /// The capture's id.
    pub(crate) id: u64,
    /// Eager uses stamped with an epoch below this are known to have completed.
    pub(crate) complete_before: u64,
}

impl CaptureView {
    /// No capture anywhere.
    pub(crate) const NONE: Self = Self {
        any_active: false,
        capture: None,
    };

    pub(super) fn tag(&self) -> Option<u64> {
        self.capture.map(|capture| capture.id)
    }
}

/// A capture that used a buffer, and the bytes it used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CapturedUse {
    id: u64,
    bytes: CapturedBytes,
}

/// The bytes of a buffer that captured work used and wrote, each as one hull (more than were
/// touched, never less).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct CapturedBytes {
    used: Option<ByteRange>,
    written: Option<ByteRange>,
}

impl CapturedBytes {
    fn add(&mut self, range: ByteRange, access: Access) {
        let grow = |hull: Option<ByteRange>| Some(hull.map_or(range, |hull| hull.hull(range)));
        self.used = grow(self.used);
        if access == Access::Write {
            self.written = grow(self.written);
        }
    }

    /// Whether an `access` of `range` conflicts with these: a write with any byte used, a read
    /// with any byte written.
    fn conflicts(&self, range: ByteRange, access: Access) -> bool {
        let bytes = match access {
            Access::Write => self.used,
            Access::Read => self.written,
        };
        bytes.is_some_and(|bytes| bytes.overlaps(range))
    }
}

/// The captures whose graphs' launches must wait for an eager use ([`UseState::launches_after`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FencedCaptures {
    /// These captures.
    These(Vec<u64>),
    /// Every tracked capture (the buffer was used by more than it remembers).
    Any,
}

impl FencedCaptures {
    /// Adds `other`'s captures (for an operation on several buffers).
    pub(crate) fn merge(&mut self, other: Self) {
        match (&mut *self, other) {
            (Self::Any, _) => {}
            (_, Self::Any) => *self = Self::Any,
            (Self::These(ids), Self::These(more)) => {
                for id in more {
                    if !ids.contains(&id) {
                        ids.push(id);
                    }
                }
            }
        }
    }
}

impl<E: UseEvent> UseState<E> {
    /// Whether a capture ever used the buffer.
    #[inline]
    pub(crate) fn used_in_graphs(&self) -> bool {
        !self.graphs.is_empty() || !self.unbound.is_empty()
    }

    /// Whether eager work that makes an `access` of `range` must wait for the launches of
    /// graphs ended from `capture`: a write, when that capture used bytes of `range`; a read,
    /// when it wrote some (past [`CAPTURES_KEPT`] captures: any capture, against the bytes all
    /// captures together used and wrote).
    pub(crate) fn waits_for_capture(&self, capture: u64, range: ByteRange, access: Access) -> bool {
        if self.many_captures {
            return self.all_captured.conflicts(range, access);
        }
        self.captures
            .iter()
            .any(|used| used.id == capture && used.bytes.conflicts(range, access))
    }

    /// The captures whose graphs' launches must wait for eager work just recorded that makes an
    /// `access` of `range`: for a write, those that used bytes of it; for a read, those that
    /// wrote some. `None` when there are none.
    pub(crate) fn launches_after(
        &self,
        range: ByteRange,
        access: Access,
    ) -> Option<FencedCaptures> {
        if self.many_captures {
            return self
                .all_captured
                .conflicts(range, access)
                .then_some(FencedCaptures::Any);
        }
        let ids: Vec<u64> = self
            .captures
            .iter()
            .filter(|used| used.bytes.conflicts(range, access))
            .map(|used| used.id)
            .collect();
        (!ids.is_empty()).then_some(FencedCaptures::These(ids))
    }

    /// Remembers the graph pool of the capture `id`, which used the buffer through `stream`
    /// (an `access` of `range`).
    ///
    /// Captures recaptured into one pool share its entry; past [`PRUNE_GRAPHS_AT`] entries
    /// (and at each doubling) the pools that died are dropped: no graph of theirs is left.
    #[cold]
    pub(super) fn note_graph<S: UseStream<Event = E>>(
        &mut self,
        stream: &S,
        id: u64,
        range: ByteRange,
        access: Access,
    ) {
        self.all_captured.add(range, access);
        if !self.many_captures {
            if let Some(used) = self.captures.iter_mut().find(|used| used.id == id) {
                used.bytes.add(range, access);
            } else if self.captures.len() < CAPTURES_KEPT {
                let mut bytes = CapturedBytes::default();
                bytes.add(range, access);
                self.captures.push(CapturedUse { id, bytes });
            } else {
                // Bounded: past this, every fenced launch is waited for (more than needed, never
                // less).
                self.captures.clear();
                self.many_captures = true;
            }
        }
        let tag = match self.last_graph {
            Some((capture, tag)) if capture == id => tag,
            _ => {
                let tag = stream.graph_pool_of(id);
                if tag != NO_POOL {
                    self.last_graph = Some((id, tag));
                }
                tag
            }
        };
        if !self.unbound.is_empty() {
            self.settle_unbound(
                |capture| stream.capture_is_active(capture),
                |capture| stream.graph_pool_of(capture),
            );
        }
        if tag == NO_POOL {
            if !self.unbound.contains(&id) {
                self.unbound.push(id);
            }
            return;
        }
        self.unbound.retain(|&capture| capture != id);
        self.add_graph(stream, tag);
    }

    /// Looks the unbound captures up again: those bound since are remembered by their pool,
    /// those that ended with no pool as [`NO_POOL`]; the others stay listed.
    pub(super) fn settle_unbound(
        &mut self,
        active: impl Fn(u64) -> bool,
        pool_of: impl Fn(u64) -> u64,
    ) {
        let mut found = Vec::new();
        self.unbound.retain(|&capture| {
            let tag = pool_of(capture);
            if tag != NO_POOL || !active(capture) {
                found.push(tag);
                false
            } else {
                true
            }
        });
        for tag in found {
            if !self.graphs.contains(&tag) {
                self.graphs.push(tag);
            }
        }
    }

    fn add_graph<S: UseStream<Event = E>>(&mut self, stream: &S, tag: u64) {
        if self.graphs.contains(&tag) || self.graphs.contains(&NO_POOL) {
            return;
        }
        let len = self.graphs.len();
        if len >= PRUNE_GRAPHS_AT && len.is_power_of_two() {
            self.graphs
                .retain(|&tag| tag == NO_POOL || stream.graph_pool_is_live(tag));
        }
        self.graphs.push(tag);
    }

    /// How many graph pools are remembered.
    #[cfg(test)]
    pub(crate) fn graphs_remembered(&self) -> usize {
        self.graphs.len()
    }
}
