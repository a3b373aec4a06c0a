//! Pool blocks as the host side of asynchronous copies: [`PinnedBlock`] (bytes) and
//! [`TypedPinnedBlock`] are [`HostSource`]s and [`HostSink`]s.
//!
//! A block handed to `copy_*_host_async` by value travels inside the returned
//! [`PendingCopy`](super::PendingCopy), which gives it back only once the stream has passed the
//! copy, so staging through the [`PinnedPool`](crate::PinnedPool) needs no `unsafe`: the
//! transfer layer's pipelined copies fill a block, hand it to the copy engine, and get it back
//! to fill again. A block's memory is a pool allocation that does not move when the block value
//! moves, and stays valid for the block's [`len`](PinnedBlock::len) bytes while it lives.

use super::host::{HostSink, HostSource, sealed};
use super::tracker::StreamTracker;
use crate::element::Element;
use crate::pinned_pool::{PinnedBlock, TypedPinnedBlock};

impl sealed::HostSide<u8> for PinnedBlock {
    super::host::owned_refusal!();
    fn host_len(&self) -> usize {
        self.len()
    }
    fn host_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        None
    }
}

impl sealed::HostSideMut<u8> for PinnedBlock {
    fn host_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
}

impl HostSource<u8> for PinnedBlock {}
impl HostSink<u8> for PinnedBlock {}

impl<T: Element> sealed::HostSide<T> for TypedPinnedBlock<T> {
    super::host::owned_refusal!();
    fn host_len(&self) -> usize {
        self.len()
    }
    fn host_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr().cast()
    }
    fn host_tracker(&self) -> Option<&StreamTracker> {
        None
    }
}

impl<T: Element> sealed::HostSideMut<T> for TypedPinnedBlock<T> {
    fn host_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr().cast()
    }
}

impl<T: Element> HostSource<T> for TypedPinnedBlock<T> {}
impl<T: Element> HostSink<T> for TypedPinnedBlock<T> {}
