//! [`StreamMarks`]: rising sequence numbers one stream writes, in order, into one word of mapped
//! host memory, so host threads learn how far the stream has got with plain loads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::MappedWords;
use crate::error::{DriverError, Result};
use crate::stream::Stream;

/// A point on a [`StreamMarks`] stream: reached once the stream has passed everything queued
/// before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Mark(u64);

impl Mark {
    /// The sequence number the stream writes when it gets here.
    pub fn value(self) -> u64 {
        self.0
    }
}

/// Progress marks of one stream: [`mark`](Self::mark) queues `cuStreamWriteValue64` of the next
/// sequence number into one word of a [`MappedWords`] page, and since a stream runs its work in
/// order and the numbers are queued in rising order (under a lock), the word only grows: a
/// word at or past a mark's number proves the stream passed that mark, and every copy queued
/// before it has landed. A pipeline queues chunk copies with a mark behind each and lets other
/// threads wait for each chunk's mark ([`wait`](Self::wait)) with no driver call and no event:
/// what an event per chunk costs (`cuEventRecord`, then `cuEventQuery` or
/// `cuEventSynchronize` from every waiting thread, which contend with the queuing thread inside
/// the driver) becomes one stream memory operation and atomic loads.
///
/// The marks belong to one stream, fixed at construction: marks from two streams would make
/// the word jump past work the other stream has not done, so [`mark`](Self::mark) refuses every
/// other stream, and the word is the marks' alone while they live: a second `StreamMarks` on it
/// is refused, and so are [`MappedWords::store`] and [`MappedWords::enqueue_write`] into it
/// (see [Claimed words](MappedWords#claimed-words)). Marks on a word start above every number
/// ever queued into it or stored in it before, so a word handed on to another stream's marks
/// ([`into_parts`](Self::into_parts), or a drop) is safe too: a late write of the old stream can
/// only make the word fall back, which delays a waiter and never releases one early.
#[derive(Debug)]
pub struct StreamMarks {
    words: Arc<MappedWords>,
    index: usize,
    stream: u64,
    /// The last number queued (written under this lock, so queue order is number order).
    last: Mutex<u64>,
    spin: Duration,
}

impl StreamMarks {
    /// How long [`wait`](Self::wait) spins on the word before it yields between loads.
    pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);
    /// How long [`wait`](Self::wait) yields between loads (asking the stream for its error
    /// now and then) before it blocks in `cuStreamSynchronize`.
    pub const YIELD_FOR: Duration = Duration::from_millis(20);

    /// Marks of `stream` in word `index` of `words`, starting above `last` (the number the
    /// word's previous owner wrote last; 0 for a fresh word) and above every number queued into
    /// the word or stored in it before, whatever `last` says.
    ///
    /// # Errors
    /// `InvalidArgument` when `index` is past the end of `words`, `stream` belongs to another
    /// context than the words' mapping, other marks hold the word, or it holds `u64::MAX` (no
    /// number is left above it).
    pub fn new(words: Arc<MappedWords>, index: usize, stream: &Stream, last: u64) -> Result<Self> {
        if index >= words.len() {
            return Err(DriverError::invalid(
                "StreamMarks::new",
                format!("word {index} is past the end of {} words", words.len()),
            ));
        }
        if stream.context().as_raw() != words.context().as_raw() {
            return Err(DriverError::invalid(
                "StreamMarks::new",
                "the stream belongs to another context than the words' mapping",
            ));
        }
        let Some(floor) = words.claim(index) else {
            return Err(DriverError::invalid(
                "StreamMarks::new",
                format!("word {index} already belongs to other marks"),
            ));
        };
        let last = last.max(floor);
        if last == u64::MAX {
            words.release(index);
            return Err(DriverError::invalid(
                "StreamMarks::new",
                format!("word {index} holds u64::MAX: no mark is left above it"),
            ));
        }
        Ok(Self {
            words,
            index,
            stream: stream.id(),
            last: Mutex::new(last),
            spin: Self::DEFAULT_SPIN,
        })
    }

    /// The word and the last number queued into it, to hand to the next owner of the word
    /// (which may claim it as soon as this returns).
    pub fn into_parts(self) -> (Arc<MappedWords>, usize, u64) {
        let last = *self.last.lock();
        let (words, index) = (Arc::clone(&self.words), self.index);
        drop(self);
        (words, index, last)
    }

    /// Whether `stream` is the stream these marks belong to.
    pub fn belongs_to(&self, stream: &Stream) -> bool {
        stream.id() == self.stream
    }

    /// Queues on `stream` (the marks' own) the write of the next number, behind everything
    /// queued on it so far, and returns the mark it writes.
    ///
    /// # Errors
    /// `InvalidArgument` for another stream; [`GraphError::Capturing`](crate::GraphError::Capturing)
    /// while the stream captures (nothing queued, no number used); the driver's error when the
    /// write cannot be queued (a device without stream memory operations among them).
    pub fn mark(&self, stream: &Stream) -> Result<Mark> {
        if !self.belongs_to(stream) {
            return Err(DriverError::invalid(
                "StreamMarks::mark",
                "the marks belong to another stream",
            ));
        }
        let mut last = self.last.lock();
        let value = *last + 1;
        self.words
            .enqueue_claimed_write(stream, self.index, value)?;
        *last = value;
        Ok(Mark(value))
    }

    /// Whether the stream has passed `mark` (one atomic load).
    pub fn is_reached(&self, mark: Mark) -> bool {
        self.words
            .load(self.index)
            .is_some_and(|word| word >= mark.0)
    }

    /// Blocks until the stream has passed `mark`: spins on the word, then yields between loads
    /// (asking the stream with `cuStreamQuery` every 64 loads, so a failed stream's error comes
    /// back), then, past [`YIELD_FOR`](Self::YIELD_FOR), blocks in `cuStreamSynchronize`.
    ///
    /// # Errors
    /// `InvalidArgument` for another stream; the failed stream's error.
    pub fn wait(&self, mark: Mark, stream: &Stream) -> Result<()> {
        if !self.belongs_to(stream) {
            return Err(DriverError::invalid(
                "StreamMarks::wait",
                "the marks belong to another stream",
            ));
        }
        if self.is_reached(mark) {
            return Ok(());
        }
        let start = Instant::now();
        let mut loads: u32 = 0;
        let mut yielding = false;
        loop {
            if self.is_reached(mark) {
                return Ok(());
            }
            loads = loads.wrapping_add(1);
            if loads.is_multiple_of(64) {
                let waited = start.elapsed();
                if waited >= self.spin + Self::YIELD_FOR {
                    break;
                }
                if waited >= self.spin {
                    yielding = true;
                    if stream.query()? {
                        break;
                    }
                }
            }
            if yielding {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        stream.synchronize()?;
        // The stream finished everything queued, the mark's write among them: the mark is
        // passed. The word can still show less when a late write of the word's previous owner
        // (another stream, queued before these marks claimed it) landed after this one; it
        // holds up waiters on this word, never releases one early.
        if !self.is_reached(mark) {
            tracing::debug!(
                word = ?self.words.load(self.index),
                mark = mark.0,
                "a stream mark was passed, but its word fell back behind a previous owner's late write"
            );
        }
        Ok(())
    }
}

impl Drop for StreamMarks {
    fn drop(&mut self) {
        self.words.release(self.index);
    }
}
