//! The queued operations whose completion the coordinator has not seen yet, one FIFO per
//! stream: events recorded on one stream complete in the order they were recorded, so each
//! stream's queue is polled from its front, and a slow stream holds back only its own.

use std::collections::{HashMap, VecDeque};

use super::OperationId;

/// Queued operations per stream ([`Stream::id`](cuweave_driver::Stream::id)), each in the
/// order their completion events were recorded. Streams with nothing queued have no entry, so
/// the map is bounded by the streams with work in flight.
#[derive(Debug, Default)]
pub(super) struct StreamQueues {
    by_stream: HashMap<u64, VecDeque<OperationId>>,
    len: usize,
}

impl StreamQueues {
    /// Queues `id`, whose completion event was just recorded on `stream`.
    pub(super) fn push(&mut self, stream: u64, id: OperationId) {
        self.by_stream.entry(stream).or_default().push_back(id);
        self.len += 1;
    }

    /// Operations queued on all streams.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Streams with something queued.
    #[cfg(test)]
    pub(super) fn streams(&self) -> usize {
        self.by_stream.len()
    }

    /// Drops `id` if it is at the front of `stream`'s queue (decided by the waiter). One
    /// decided elsewhere in a queue is dropped when a poll reaches it.
    pub(super) fn remove_front(&mut self, stream: u64, id: OperationId) {
        let Some(queue) = self.by_stream.get_mut(&stream) else {
            return;
        };
        if queue.front() == Some(&id) {
            queue.pop_front();
            self.len -= 1;
            if queue.is_empty() {
                self.by_stream.remove(&stream);
            }
        }
    }

    /// Takes off every queue, wherever they stand in it, the operations `pick` chooses, and
    /// returns them (each stream's in queue order). For operations whose completion does not
    /// follow their stream's order: those recorded into a capture, complete once it has ended
    /// even behind eager work the GPU has not finished. O(queued).
    pub(super) fn remove_where(
        &mut self,
        mut pick: impl FnMut(OperationId) -> bool,
    ) -> Vec<OperationId> {
        let mut removed = Vec::new();
        let Self { by_stream, len } = self;
        by_stream.retain(|_, queue| {
            queue.retain(|&id| {
                let taken = pick(id);
                if taken {
                    removed.push(id);
                }
                !taken
            });
            !queue.is_empty()
        });
        *len -= removed.len();
        removed
    }

    /// Walks every stream's queue from its front: `look(id)` says whether the front is done
    /// ([`Front::Done`], taken off and returned in order), already decided or gone
    /// ([`Front::Drop`], taken off), or not yet ([`Front::NotYet`], which ends that stream's
    /// walk). Done operations come back with what `look` said about them.
    pub(super) fn drain_done<T>(
        &mut self,
        mut look: impl FnMut(OperationId) -> Front<T>,
    ) -> Vec<(OperationId, T)> {
        let mut done = Vec::new();
        let Self { by_stream, len } = self;
        by_stream.retain(|_, queue| {
            while let Some(&id) = queue.front() {
                match look(id) {
                    Front::NotYet => break,
                    Front::Drop => {}
                    Front::Done(outcome) => done.push((id, outcome)),
                }
                queue.pop_front();
                *len -= 1;
            }
            !queue.is_empty()
        });
        done
    }
}

/// What a poll found at the front of a stream's queue.
#[derive(Debug)]
pub(super) enum Front<T> {
    /// The GPU has not reached it (or cannot be asked now): the rest of that stream waits.
    NotYet,
    /// No longer queued (decided by the waiter, or gone): just drop it from the queue.
    Drop,
    /// The GPU reached it (or watching it failed): the outcome.
    Done(T),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_stream_holds_back_only_its_own_queue() {
        let mut queues = StreamQueues::default();
        let (slow, fast) = (1, 2);
        queues.push(slow, OperationId::new(0, 1));
        for id in 2..=5 {
            queues.push(fast, OperationId::new(0, id));
        }
        queues.push(slow, OperationId::new(0, 6));
        assert_eq!(queues.len(), 6);
        // The GPU has finished everything but op 1 (and op 6 behind it on the same stream).
        let done = queues.drain_done(|id| {
            if id.get() == 1 {
                Front::NotYet
            } else {
                Front::Done(())
            }
        });
        let done: Vec<u64> = done.into_iter().map(|(id, ())| id.get()).collect();
        assert_eq!(done, vec![2, 3, 4, 5]);
        assert_eq!((queues.len(), queues.streams()), (2, 1));
        // The waiter decides op 1; op 6 is then at the front.
        queues.remove_front(slow, OperationId::new(0, 6));
        assert_eq!(queues.len(), 2, "op 6 is not at the front: kept");
        queues.remove_front(slow, OperationId::new(0, 1));
        let done = queues.drain_done(|_| Front::Done(()));
        assert_eq!(done.len(), 1);
        assert_eq!((queues.len(), queues.streams()), (0, 0));
    }

    #[test]
    fn removing_by_choice_takes_operations_from_anywhere_in_a_queue() {
        let mut queues = StreamQueues::default();
        // Stream 1: an eager op still running (1), then ops 2 and 3; stream 2: op 4 alone.
        for id in 1..=3 {
            queues.push(1, OperationId::new(0, id));
        }
        queues.push(2, OperationId::new(0, 4));
        let removed = queues.remove_where(|id| id.get() % 2 == 0);
        let mut removed: Vec<u64> = removed.into_iter().map(OperationId::get).collect();
        removed.sort_unstable();
        assert_eq!(removed, vec![2, 4]);
        assert_eq!(
            (queues.len(), queues.streams()),
            (2, 1),
            "stream 2 emptied: gone"
        );
        // The rest keeps its order: op 1 still holds back op 3.
        let done = queues.drain_done(|id| {
            if id.get() == 1 {
                Front::NotYet
            } else {
                Front::Done(())
            }
        });
        assert!(done.is_empty());
        let done = queues.drain_done(|_| Front::Done(()));
        let done: Vec<u64> = done.into_iter().map(|(id, ())| id.get()).collect();
        assert_eq!(done, vec![1, 3]);
        assert_eq!((queues.len(), queues.streams()), (0, 0));
        assert!(queues.remove_where(|_| true).is_empty());
    }

    #[test]
    fn decided_operations_are_dropped_and_a_stream_walk_stops_at_the_first_not_yet() {
        let mut queues = StreamQueues::default();
        for id in 1..=4 {
            queues.push(7, OperationId::new(0, id));
        }
        let done = queues.drain_done(|id| match id.get() {
            1 => Front::Drop,
            2 => Front::Done("ok"),
            _ => Front::NotYet,
        });
        assert_eq!(done, vec![(OperationId::new(0, 2), "ok")]);
        assert_eq!(queues.len(), 2);
    }
}
