//! [`StreamAllocation`]: the receipt for one allocation of the
//! [`StreamOrderedAllocator`](super::StreamOrderedAllocator), and the allocator's entry for it
//! (its owner stream, the streams it was given to, the capture it was made in).

use std::sync::Arc;

use cuweave_driver::memory::DevicePtr;
use serde::{Deserialize, Serialize};

use crate::stream::PriorityStream;

/// One allocation of a [`StreamOrderedAllocator`], owned by the stream it was made on.
///
/// It is a receipt, not the memory: the device address comes from
/// [`StreamOrderedAllocator::device_ptr`], which checks the stream that wants it is ordered
/// after the owner. Freeing goes through the allocator.
///
/// [`StreamOrderedAllocator`]: super::StreamOrderedAllocator
/// [`StreamOrderedAllocator::device_ptr`]: super::StreamOrderedAllocator::device_ptr
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StreamAllocation {
    pub(super) id: u64,
    pub(super) ptr: DevicePtr,
    pub(super) bytes: usize,
    pub(super) requested: usize,
    pub(super) owner: u64,
    pub(super) device: usize,
}

impl StreamAllocation {
    /// The allocation's id (unique within the process).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Its size after rounding to its size class.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The size asked for.
    pub fn requested(&self) -> usize {
        self.requested
    }

    /// The id of the stream that owns it.
    pub fn owner(&self) -> u64 {
        self.owner
    }

    /// The device it is on.
    pub fn device(&self) -> usize {
        self.device
    }
}

#[derive(Debug)]
pub(super) struct Entry {
    pub(super) allocation: StreamAllocation,
    pub(super) class: usize,
    pub(super) owner: Arc<PriorityStream>,
    pub(super) users: Vec<Arc<PriorityStream>>,
    /// The capture the allocation was recorded into (a graph's allocation node), or `None`
    /// for an allocation made eagerly.
    pub(super) capture: Option<u64>,
}
