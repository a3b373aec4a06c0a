//! The engine's allocation path while a stream capture is active: no event polling, no
//! out-of-memory retry (both would wait on or query the device), and a miss only where the
//! caller allows it.

use cuweave_driver::graph::GraphError;

use super::super::pool::Grant;
use super::super::size_class::{round_size, segment_size};
use super::super::stream_uses::{Marker, StreamKey};
use super::{Engine, Upstream};
use crate::error::{MemoryError, Result};

impl<E: Marker> Engine<E> {
    /// `bytes` rounded to the allocator's granularity; a size too large to round is counted
    /// and reported as out-of-memory.
    #[inline]
    pub(super) fn round_request(&self, stream: StreamKey, bytes: usize) -> Result<usize> {
        round_size(bytes).map_err(|error| match error {
            MemoryError::OutOfMemory { .. } => self.out_of_memory(stream, bytes, None),
            other => other,
        })
    }

    /// A block of at least `bytes` for `stream` from the cache, else (with `allow_miss`) from a
    /// new upstream segment; never polls pending blocks nor retries after out-of-memory.
    pub fn allocate_quiet(
        &self,
        stream: StreamKey,
        bytes: usize,
        upstream: &impl Upstream,
        allow_miss: bool,
    ) -> Result<Grant> {
        let rounded = self.round_request(stream, bytes)?;
        if let Some(grant) = self
            .shard(stream)
            .pools
            .lock()
            .take_free(stream, rounded, bytes)
        {
            return Ok(grant);
        }
        if !allow_miss {
            return Err(MemoryError::Driver(
                GraphError::Capturing {
                    operation: "CachingAllocator::allocate",
                    reason: "the graph pool has no free block of this size and the capture's miss policy is Fail",
                }
                .into(),
            ));
        }
        let Some(segment) = segment_size(rounded) else {
            return Err(self.out_of_memory(stream, rounded, None));
        };
        match upstream.allocate_segment(segment) {
            Ok(ptr) => Ok(self.add_segment(stream, ptr, segment, rounded, bytes)),
            Err(error) if error.is_out_of_memory() => {
                Err(self.out_of_memory(stream, rounded, None))
            }
            Err(error) => Err(error),
        }
    }
}
