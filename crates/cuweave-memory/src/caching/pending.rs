//! [`PendingFrees`]: the blocks of one shard that were freed while work queued on other streams
//! may still use them, and the markers each waits for.
//!
//! Markers recorded on one stream complete in the order they were recorded. So, as PyTorch's
//! allocator does, the markers are queued per stream and a poll stops at each stream's first
//! unfinished marker: a poll queries once per stream that has frees waiting, plus once per
//! marker that completed, not once per waiting block. A thousand `record_stream` frees waiting
//! behind a busy communication stream cost the next allocation one query, not a thousand.
//!
//! The ordering only saves queries, it is never trusted for safety: a marker leaves its queue
//! only when its own query says it completed. A queue out of recording order (two threads that
//! recorded on one stream and queued in the other order) delays a block, never hands it out
//! early. A marker whose stream is not known ([`Marker::stream`] is `None`, the default
//! streams) is queried on its own at every poll.

use std::collections::{HashMap, VecDeque};

use super::block::BlockId;
use super::stream_uses::Marker;
use crate::error::Result;

/// A marker and the block that waits for it.
#[derive(Debug)]
struct Waiting<E> {
    marker: E,
    block: BlockId,
}

/// Blocks freed behind other streams' work, each waiting for its markers (see the module docs).
#[derive(Debug)]
pub(crate) struct PendingFrees<E> {
    /// Markers by the identity of the stream they were recorded on, in the order they came.
    queues: HashMap<u64, VecDeque<Waiting<E>>>,
    /// Markers whose stream is not known: each is queried at every poll.
    unordered: Vec<Waiting<E>>,
    /// The waiting blocks, with how many of their markers have not been seen complete.
    blocks: HashMap<BlockId, usize>,
}

impl<E> Default for PendingFrees<E> {
    fn default() -> Self {
        Self {
            queues: HashMap::new(),
            unordered: Vec::new(),
            blocks: HashMap::new(),
        }
    }
}

impl<E: Marker> PendingFrees<E> {
    /// Blocks waiting.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block waits.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Adds `block`, which waits for every one of `markers` (not empty; a block with nothing
    /// to wait for is free already).
    pub fn push(&mut self, block: BlockId, markers: Vec<E>) {
        debug_assert!(!markers.is_empty());
        let previous = self.blocks.insert(block, markers.len());
        debug_assert!(previous.is_none(), "block {block} is already pending");
        for marker in markers {
            let waiting = Waiting { marker, block };
            match waiting.marker.stream() {
                Some(stream) => self.queues.entry(stream).or_default().push_back(waiting),
                None => self.unordered.push(waiting),
            }
        }
    }

    /// Moves the markers seen complete into `completed` (for the caller to drop once it has let
    /// go of its lock: dropping a pooled event returns it to its pool) and the blocks left with
    /// nothing to wait for into `ready`; never blocks.
    ///
    /// A marker whose query fails stays, and so does its block: a block is never handed out on
    /// a guess.
    pub fn poll(&mut self, completed: &mut Vec<E>, ready: &mut Vec<BlockId>) {
        let blocks = &mut self.blocks;
        self.queues.retain(|_, queue| {
            while let Some(front) = queue.front() {
                if !is_complete(&front.marker) {
                    break;
                }
                let done = queue.pop_front().expect("the front exists");
                settle(blocks, done, completed, ready);
            }
            !queue.is_empty()
        });
        let mut index = 0;
        while index < self.unordered.len() {
            if is_complete(&self.unordered[index].marker) {
                let done = self.unordered.swap_remove(index);
                settle(blocks, done, completed, ready);
            } else {
                index += 1;
            }
        }
    }

    /// Waits for every marker and moves the blocks whose markers all completed into `ready`.
    /// A block with a marker that could not be waited for is left out: it is never reused.
    ///
    /// # Errors
    /// The first error of a wait (every other marker is still waited for).
    pub fn wait_all(self, ready: &mut Vec<BlockId>) -> Result<()> {
        let Self {
            queues,
            unordered,
            mut blocks,
        } = self;
        let mut first_error = None;
        let all = queues.into_values().flatten().chain(unordered);
        for Waiting { marker, block } in all {
            match marker.wait() {
                Ok(()) => {
                    if let Some(left) = blocks.get_mut(&block) {
                        *left -= 1;
                    }
                }
                Err(error) => {
                    tracing::error!(%error, "waiting for a block's stream use failed; the block is never reused");
                    blocks.remove(&block);
                    first_error.get_or_insert(error);
                }
            }
        }
        ready.extend(
            blocks
                .into_iter()
                .filter(|&(_, left)| left == 0)
                .map(|(block, _)| block),
        );
        first_error.map_or(Ok(()), Err)
    }
}

/// Whether `marker` has completed; a failed query counts as not yet (and is logged).
fn is_complete<E: Marker>(marker: &E) -> bool {
    match marker.is_complete() {
        Ok(done) => done,
        Err(error) => {
            tracing::warn!(%error, "querying a block's stream-use event failed; keeping the block");
            false
        }
    }
}

/// Counts `done`'s marker off its block, which goes to `ready` when it was the last.
fn settle<E>(
    blocks: &mut HashMap<BlockId, usize>,
    done: Waiting<E>,
    completed: &mut Vec<E>,
    ready: &mut Vec<BlockId>,
) {
    completed.push(done.marker);
    if let Some(left) = blocks.get_mut(&done.block) {
        *left -= 1;
        if *left == 0 {
            blocks.remove(&done.block);
            ready.push(done.block);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use super::*;
    use crate::error::MemoryError;

    /// A marker on a known stream that counts the queries made of it.
    #[derive(Debug, Clone)]
    struct Counted {
        done: Arc<AtomicBool>,
        stream: Option<u64>,
        queries: Arc<AtomicUsize>,
        fails: bool,
    }

    impl Counted {
        fn on(stream: Option<u64>, queries: &Arc<AtomicUsize>) -> Self {
            Self {
                done: Arc::default(),
                stream,
                queries: Arc::clone(queries),
                fails: false,
            }
        }

        fn complete(&self) {
            self.done.store(true, Ordering::SeqCst);
        }
    }

    impl Marker for Counted {
        fn is_complete(&self) -> Result<bool> {
            self.queries.fetch_add(1, Ordering::SeqCst);
            if self.fails {
                return Err(MemoryError::InvalidStream {
                    operation: "query",
                    reason: "the test's marker fails",
                });
            }
            Ok(self.done.load(Ordering::SeqCst))
        }

        fn wait(&self) -> Result<()> {
            if self.fails {
                return Err(MemoryError::InvalidStream {
                    operation: "wait",
                    reason: "the test's marker fails",
                });
            }
            self.complete();
            Ok(())
        }

        fn stream(&self) -> Option<u64> {
            self.stream
        }
    }

    fn poll(pending: &mut PendingFrees<Counted>) -> Vec<BlockId> {
        let mut completed = Vec::new();
        let mut ready = Vec::new();
        pending.poll(&mut completed, &mut ready);
        ready.sort_unstable();
        ready
    }

    #[test]
    fn a_thousand_frees_behind_one_busy_stream_cost_a_poll_one_query() {
        let queries = Arc::new(AtomicUsize::new(0));
        let mut pending = PendingFrees::default();
        let markers: Vec<Counted> = (0..1000).map(|_| Counted::on(Some(7), &queries)).collect();
        for (block, marker) in markers.iter().enumerate() {
            pending.push(block as BlockId, vec![marker.clone()]);
        }
        for _ in 0..10 {
            assert!(poll(&mut pending).is_empty());
        }
        assert_eq!(queries.load(Ordering::SeqCst), 10, "one query per poll");
        assert_eq!(pending.blocks(), 1000);

        // The stream moves past the first 400 frees.
        markers[..400].iter().for_each(Counted::complete);
        queries.store(0, Ordering::SeqCst);
        assert_eq!(poll(&mut pending), (0..400).collect::<Vec<_>>());
        assert_eq!(queries.load(Ordering::SeqCst), 401);
        markers.iter().for_each(Counted::complete);
        assert_eq!(poll(&mut pending).len(), 600);
        assert!(pending.is_empty());
        assert!(pending.queues.is_empty(), "an emptied queue is dropped");
    }

    #[test]
    fn a_block_waits_for_its_markers_on_every_stream() {
        let queries = Arc::new(AtomicUsize::new(0));
        let mut pending = PendingFrees::default();
        let (a, b, c) = (
            Counted::on(Some(1), &queries),
            Counted::on(Some(2), &queries),
            Counted::on(None, &queries),
        );
        pending.push(3, vec![a.clone(), b.clone(), c.clone()]);
        a.complete();
        c.complete();
        assert!(poll(&mut pending).is_empty(), "stream 2 is still running");
        b.complete();
        assert_eq!(poll(&mut pending), vec![3]);
        assert!(pending.is_empty());
    }

    #[test]
    fn a_queue_out_of_recording_order_delays_but_never_releases_early() {
        let queries = Arc::new(AtomicUsize::new(0));
        let mut pending = PendingFrees::default();
        // Queued later-recorded first: the front has not completed, the one behind it has.
        let (later, earlier) = (
            Counted::on(Some(5), &queries),
            Counted::on(Some(5), &queries),
        );
        pending.push(1, vec![later.clone()]);
        pending.push(2, vec![earlier.clone()]);
        earlier.complete();
        assert!(poll(&mut pending).is_empty(), "delayed behind the front");
        later.complete();
        assert_eq!(poll(&mut pending), vec![1, 2]);
    }

    #[test]
    fn unordered_markers_are_each_queried() {
        let queries = Arc::new(AtomicUsize::new(0));
        let mut pending = PendingFrees::default();
        let markers: Vec<Counted> = (0..4).map(|_| Counted::on(None, &queries)).collect();
        for (block, marker) in markers.iter().enumerate() {
            pending.push(block as BlockId, vec![marker.clone()]);
        }
        markers[2].complete();
        assert_eq!(poll(&mut pending), vec![2]);
        assert_eq!(queries.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn a_failed_query_keeps_the_block_and_a_failed_wait_never_frees_it() {
        let queries = Arc::new(AtomicUsize::new(0));
        let mut pending = PendingFrees::default();
        let mut broken = Counted::on(Some(1), &queries);
        broken.fails = true;
        let fine = Counted::on(Some(2), &queries);
        pending.push(1, vec![broken]);
        pending.push(2, vec![fine.clone()]);
        fine.complete();
        assert_eq!(poll(&mut pending), vec![2]);
        assert_eq!(pending.blocks(), 1, "the failing block stays");

        let mut ready = Vec::new();
        assert!(
            pending.wait_all(&mut ready).is_err(),
            "the failed wait is reported"
        );
        assert!(ready.is_empty(), "never handed out on a guess");
    }

    #[test]
    fn wait_all_releases_every_block_whose_markers_completed() {
        let queries = Arc::new(AtomicUsize::new(0));
        let mut pending = PendingFrees::default();
        for block in 0..6 {
            let stream = (block % 3 != 0).then_some(u64::from(block % 2));
            pending.push(
                block,
                vec![
                    Counted::on(stream, &queries),
                    Counted::on(Some(9), &queries),
                ],
            );
        }
        let mut ready = Vec::new();
        pending.wait_all(&mut ready).expect("every wait succeeds");
        ready.sort_unstable();
        assert_eq!(ready, (0..6).collect::<Vec<_>>());
    }
}
