//! [`PinnedBlock`] and [`TypedPinnedBlock`]: page-locked host memory lent by a
//! [`PinnedPool`](super::PinnedPool), returned to it on drop.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use cuweave_driver::memory::{DevicePtr, HostAllocation};
use cuweave_driver::{OwnedPooledEvent, Stream};

use super::pool::Inner;
use crate::element::Element;
use crate::error::Result;

/// Page-locked host memory lent by a [`PinnedPool`](super::PinnedPool); dropping it returns the
/// memory to the pool.
///
/// The block is [`len`](Self::len) bytes as requested, inside a block of
/// [`capacity`](Self::capacity) bytes (its size class). Its start is page-aligned.
///
/// # Handing it to the GPU
/// Queue the copies or kernels that use the memory, then [`record`](Self::record) each stream
/// they run on before dropping the block: the pool hands the memory out again only once every
/// recorded stream has passed that point, so queued work never sees it reused. Recording is the
/// user's part of the contract; the unsafe copy functions that take the block's address say so.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::pinned_pool::PinnedPool;
///
/// # fn main() -> Result<(), cuweave_memory::MemoryError> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let pool = PinnedPool::new(&context);
/// let mut staging = pool.get(1 << 20)?;
/// staging.as_mut_slice().fill(7);
/// // ... queue an async copy from `staging` on `stream` ...
/// staging.record(&stream)?;
/// drop(staging); // reused only after `stream` has passed the copy
/// # Ok(())
/// # }
/// ```
#[must_use = "dropping a PinnedBlock returns it to the pool at once"]
pub struct PinnedBlock {
    /// `Some` from creation until `drop` hands it back.
    allocation: Option<HostAllocation>,
    len: usize,
    /// Events marking the last use on each recorded stream (pooled: back to the context's
    /// event pool once the block is ready again).
    events: Vec<OwnedPooledEvent>,
    /// The tags of the graph pools of the captures that used the block (see
    /// [`hold_for_graphs`](Self::hold_for_graphs)); `None` when no capture did.
    graphs: Option<Vec<u64>>,
    pool: Arc<Inner>,
}

impl PinnedBlock {
    pub(super) fn new(allocation: HostAllocation, len: usize, pool: Arc<Inner>) -> Self {
        debug_assert!(len <= allocation.len());
        Self {
            allocation: Some(allocation),
            len,
            events: Vec::new(),
            graphs: None,
            pool,
        }
    }

    fn allocation(&self) -> &HostAllocation {
        self.allocation
            .as_ref()
            .expect("a PinnedBlock holds its allocation until it is dropped")
    }

    /// The requested bytes, readable.
    pub fn as_slice(&self) -> &[u8] {
        &self.allocation().as_bytes()[..self.len]
    }

    /// The requested bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        let allocation = self
            .allocation
            .as_mut()
            .expect("a PinnedBlock holds its allocation until it is dropped");
        &mut allocation.as_bytes_mut()[..len]
    }

    /// The number of bytes requested (what the slices cover).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always `false`: the pool refuses zero-length requests.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The size of the underlying pinned block (the request's size class), at least [`len`](Self::len).
    pub fn capacity(&self) -> usize {
        self.allocation().len()
    }

    /// Whether the block is mapped into the device address space (the pool's `mapped` option).
    pub fn is_mapped(&self) -> bool {
        self.allocation().flags().device_map
    }

    /// The device address of the block's start, for kernels that read or write it directly
    /// (zero-copy).
    ///
    /// # Errors
    /// [`MemoryError::Driver`](crate::MemoryError::Driver) with `InvalidArgument` when the pool was
    /// not configured `mapped`; the driver's error otherwise.
    pub fn device_ptr(&self) -> Result<DevicePtr> {
        Ok(self.allocation().device_ptr()?)
    }

    /// Marks the work queued on `stream` so far as a use of this block: after the block is
    /// dropped, the pool does not hand it out again until `stream` has passed this point.
    ///
    /// Call it after queuing the last work that touches the block on `stream`; call it once per
    /// stream that uses the block. It records a pooled timing-free event, so it costs no
    /// allocation once the pool is warm. The stream may belong to any context or device: the
    /// block is pinned portable.
    ///
    /// # Errors
    /// The driver's error when the event cannot be created or recorded; the block is then not
    /// protected against `stream`, so synchronize the stream before dropping it.
    pub fn record(&mut self, stream: &Stream) -> Result<()> {
        let event = self.pool.event_for(stream)?;
        event.record(stream)?;
        self.events.push(event);
        Ok(())
    }

    /// Adds events recorded behind uses of the block (a typed buffer's tracked uses): it goes
    /// back to the pool's ready list only once they have completed.
    pub(crate) fn add_events(&mut self, events: impl IntoIterator<Item = OwnedPooledEvent>) {
        self.events.extend(events);
    }

    /// Marks the block as used by stream captures whose graph pools are `graph_pools` (tags, as
    /// `FreeMarkers::graph_pools` gives them): once dropped it goes back to the pool
    /// quarantined, never handed out again nor unpinned while a graph of those captures may
    /// replay with its address. The pools still alive hold it, and it becomes ready again once
    /// the last of them has died (after the context has been synchronised); with a capture no
    /// pool was bound to, it stays quarantined for good and the pool leaks it when it goes away.
    pub(crate) fn hold_for_graphs(&mut self, graph_pools: Vec<u64>) {
        self.graphs = Some(graph_pools);
    }

    /// How many stream uses have been recorded on this block since it was handed out.
    pub fn recorded_uses(&self) -> usize {
        self.events.len()
    }
}

impl Drop for PinnedBlock {
    fn drop(&mut self) {
        if let Some(allocation) = self.allocation.take() {
            let events = std::mem::take(&mut self.events);
            match self.graphs.take() {
                None => self.pool.give_back(allocation, events),
                Some(graph_pools) => {
                    Inner::give_back_for_graphs(&self.pool, allocation, events, &graph_pools);
                }
            }
        }
    }
}

impl fmt::Debug for PinnedBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedBlock")
            .field("ptr", &self.as_slice().as_ptr())
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("mapped", &self.is_mapped())
            .field("recorded_uses", &self.events.len())
            .finish()
    }
}

/// A [`PinnedBlock`] viewed as `len` elements of `T`, from
/// [`PinnedPool::get_typed`](super::PinnedPool::get_typed).
#[must_use = "dropping a TypedPinnedBlock returns it to the pool at once"]
pub struct TypedPinnedBlock<T: Element> {
    block: PinnedBlock,
    _element: PhantomData<T>,
}

impl<T: Element> TypedPinnedBlock<T> {
    /// Views `block` as `T`s; `None` when its start is not aligned for `T` or its length is not
    /// a whole number of `T`s.
    pub(super) fn new(block: PinnedBlock) -> Option<Self> {
        bytemuck::try_cast_slice::<u8, T>(block.as_slice()).ok()?;
        Some(Self {
            block,
            _element: PhantomData,
        })
    }

    /// The elements, readable.
    pub fn as_slice(&self) -> &[T] {
        // Checked in `new`: the start is aligned for `T` and the length a whole number of `T`s.
        bytemuck::cast_slice(self.block.as_slice())
    }

    /// The elements, writable.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.block.as_mut_slice())
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.block.len() / size_of::<T>()
    }

    /// Always `false`: the pool refuses zero-length requests.
    pub fn is_empty(&self) -> bool {
        self.block.is_empty()
    }

    /// The bytes the elements take.
    pub fn byte_len(&self) -> usize {
        self.block.len()
    }

    /// The untyped block, for its capacity, device pointer or bytes.
    pub fn block(&self) -> &PinnedBlock {
        &self.block
    }

    /// The untyped block, writable.
    pub fn block_mut(&mut self) -> &mut PinnedBlock {
        &mut self.block
    }

    /// Gives up the typed view.
    pub fn into_block(self) -> PinnedBlock {
        self.block
    }

    /// The device address of the first element, when the pool is `mapped`
    /// (see [`PinnedBlock::device_ptr`]).
    ///
    /// # Errors
    /// As [`PinnedBlock::device_ptr`].
    pub fn device_ptr(&self) -> Result<DevicePtr> {
        self.block.device_ptr()
    }

    /// Marks the work queued on `stream` so far as a use of this block (see
    /// [`PinnedBlock::record`]).
    ///
    /// # Errors
    /// As [`PinnedBlock::record`].
    pub fn record(&mut self, stream: &Stream) -> Result<()> {
        self.block.record(stream)
    }
}

impl<T: Element> fmt::Debug for TypedPinnedBlock<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TypedPinnedBlock")
            .field("element", &std::any::type_name::<T>())
            .field("len", &self.len())
            .field("block", &self.block)
            .finish()
    }
}
