//! [`DeviceBuffer`]: typed device memory from a memory resource, by default the caching
//! allocator of its device.

use std::marker::PhantomData;
use std::sync::Arc;

use cuweave_driver::graph::{GraphError, active_captures};
use cuweave_driver::memory::DevicePtr;
use cuweave_driver::stream::{StreamEnd, WeakStream};
use cuweave_driver::{Context, Stream};

use super::common::{Buffer, BufferCore, CoreRef, sealed::Sealed};
use super::range::allocation_bytes;
use super::raw::legacy_stream;
use super::tracker::{Origin, Owner, Part, StreamTracker};
use crate::caching::default::{check_context, with_default};
use crate::caching::{CachedBlock, CachingAllocator, Grant, ShardHandle, StreamKey};
use crate::element::Element;
use crate::error::Result;
use crate::events::StreamEvent;
use crate::resource::{MemoryResource, check_stream};

/// Where a buffer's memory came from, and where it goes back.
enum Memory {
    /// A block of a caching allocator (the default); the tracker holds its shard.
    Cached(CachedBlock),
    /// An allocation of any other memory resource.
    Resource {
        resource: Arc<dyn MemoryResource>,
        ptr: DevicePtr,
        bytes: usize,
        /// The stream it was allocated on, where it is freed while that stream's handle lives
        /// (`None` for a context-relative handle: freed on the legacy stream).
        home: Option<WeakStream>,
    },
    /// Given back (only while dropping).
    Freed,
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cached(block) => block.fmt(f),
            Self::Resource {
                resource,
                ptr,
                bytes,
                ..
            } => f
                .debug_struct("Resource")
                .field("resource", &resource.name())
                .field("ptr", &format_args!("{ptr:#x}"))
                .field("bytes", bytes)
                .finish(),
            Self::Freed => f.write_str("Freed"),
        }
    }
}

/// `len` elements of `T` in device memory, given back in stream order when dropped.
///
/// # Where the memory comes from
///
/// By default from the process-wide [`CachingAllocator`] of the device
/// ([`CachingAllocator::for_device`]): a warm allocation is a lock-protected lookup with no
/// driver call. [`with_allocator`](Self::with_allocator) (or [`CachingAllocator::buffer`]) names
/// another caching allocator, [`with_resource`](Self::with_resource) any
/// [`MemoryResource`] (the async pool, a limit or statistics adaptor, or
/// [`DriverResource`](crate::DriverResource) for plain `cuMemAlloc`).
///
/// - [`new_on(&stream, len)`](Self::new_on) allocates for `stream`, the stream the buffer is
///   first used on: the block comes from that stream's free list. This is the fast path.
/// - [`new(&context, len)`](Self::new) allocates for the context's legacy default stream (one
///   stream per context, which the blocking methods use); the buffer may be used on any stream
///   just the same.
///
/// # Dropping
///
/// Dropping never blocks on the GPU and never calls `cuMemFree`: the block goes back to its
/// allocator, which hands it out again only once every use the buffer recorded (on any stream,
/// its own included) has finished: the events the tracker recorded behind them travel with the
/// block, as `record_stream` does for raw blocks. Stream order alone would not cover a reuse on
/// the block's own stream: the next buffer made from the block may be used on any stream (or
/// by the blocking methods, on the legacy stream), and its tracker knows nothing of the old
/// uses. A buffer nothing was queued on goes straight back to its stream's free list (no event,
/// no allocation). Uses recorded by a stream capture hold the block for the capture's graph
/// pool instead (`docs/graphs.md`). Memory of another resource is deallocated in stream order
/// on the stream it was allocated on, as RMM frees a `device_buffer` (for `DriverResource`
/// that is `cuMemFree`, which blocks): that stream first waits for the buffer's uses on other
/// streams, then the resource's `deallocate` runs there, behind the work queued on it by hand.
/// If that stream's handle has been dropped, the legacy default stream waits for the handle's
/// end (an event recorded at its drop behind all its work) and for the uses, and the
/// `deallocate` runs there; so it does for a buffer allocated on a context-relative handle
/// (the legacy stream itself).
///
/// Work queued on [`device_ptr`](Buffer::device_ptr) by hand must be recorded
/// ([`Buffer::record_write`] or [`TrackedLaunch`](crate::TrackedLaunch)), or be on the stream
/// the buffer was allocated for (before the handle it was made with is dropped), to be covered.
/// Such unrecorded work on the allocation stream may still run after the drop: a cached block
/// goes back to that stream's free list, where stream order covers the next buffer's uses on
/// that stream, and the next buffer's first use on any other stream waits for the allocation
/// stream first (or for its end, once its handle is gone); a resource buffer is freed on that
/// stream.
///
/// ```no_run
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_memory::buffer::{Buffer, DeviceBuffer};
///
/// # fn main() -> cuweave_memory::Result<()> {
/// let context = Context::primary(Device::get(0)?)?;
/// let stream = Stream::new(&context, StreamFlags::NON_BLOCKING)?;
/// let mut scratch = DeviceBuffer::<f32>::new_on(&stream, 1 << 20)?; // from the cache
/// scratch.fill_async(1.0, &stream)?;
/// drop(scratch); // back to the cache; reused once the fill has run
/// let buffer = DeviceBuffer::from_slice(&context, &[1.0f32, 2.0, 3.0])?;
/// assert_eq!(buffer.to_vec()?, [1.0, 2.0, 3.0]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug)]
pub struct DeviceBuffer<T: Element> {
    core: BufferCore,
    memory: Memory,
    _element: PhantomData<T>,
}

impl<T: Element> DeviceBuffer<T> {
    /// Allocates `len` elements for use on `stream`, from the default caching allocator of the
    /// stream's device, without initializing them.
    ///
    /// The contents are whatever the memory last held. That is sound because `T` is plain data
    /// (every bit pattern is a valid value) and device memory reaches the host only through
    /// copies; use [`zeroed`](Self::zeroed) or [`fill`](Buffer::fill) for defined contents.
    ///
    /// # Errors
    /// `ZeroLength` for `len == 0` (or a zero-sized `T`), `Misaligned` when the byte size
    /// overflows, `InvalidStream` for the per-thread default stream, `WrongContext` for a stream
    /// of a context other than the device's primary one (give those
    /// [`with_allocator`](Self::with_allocator)), `OutOfMemory` when the device is full.
    #[inline]
    pub fn new_on(stream: &Stream, len: usize) -> Result<Self> {
        const OPERATION: &str = "DeviceBuffer::new_on";
        let bytes = allocation_bytes::<T>(OPERATION, len)?;
        with_default(stream.device(), |allocator| {
            check_context(allocator, stream.context(), OPERATION)?;
            Ok(Self::from_cached(
                allocator.allocate_grant(bytes, stream, OPERATION)?,
                len,
                stream,
            ))
        })
    }

    /// Allocates `len` elements from the default caching allocator of `context`'s device, for
    /// the context's legacy default stream (which the blocking methods use); the buffer may be
    /// used on any stream. See [`new_on`](Self::new_on) for the contents.
    ///
    /// # Errors
    /// As [`new_on`](Self::new_on); `WrongContext` for a context other than the device's
    /// primary one.
    pub fn new(context: &Arc<Context>, len: usize) -> Result<Self> {
        const OPERATION: &str = "DeviceBuffer::new";
        let bytes = allocation_bytes::<T>(OPERATION, len)?;
        let legacy = legacy_stream(context);
        with_default(context.device(), |allocator| {
            check_context(allocator, context, OPERATION)?;
            Ok(Self::from_cached(
                allocator.allocate_grant(bytes, &legacy, OPERATION)?,
                len,
                &legacy,
            ))
        })
    }

    /// Allocates `len` elements from `allocator` for use on `stream` (what
    /// [`CachingAllocator::buffer`] does).
    ///
    /// # Errors
    /// As [`new_on`](Self::new_on); `WrongDevice` / `WrongContext` for a stream that is not of
    /// the allocator's context.
    #[inline]
    pub fn with_allocator(
        allocator: &CachingAllocator,
        len: usize,
        stream: &Stream,
    ) -> Result<Self> {
        const OPERATION: &str = "DeviceBuffer::with_allocator";
        let bytes = allocation_bytes::<T>(OPERATION, len)?;
        check_stream(allocator.device(), stream, OPERATION)?;
        check_context(allocator, stream.context(), OPERATION)?;
        Ok(Self::from_cached(
            allocator.allocate_grant(bytes, stream, OPERATION)?,
            len,
            stream,
        ))
    }

    /// Allocates `len` elements from any memory `resource` on `stream` (RMM's
    /// `device_buffer(size, stream, mr)`). The buffer is usable on `stream` at once; other
    /// streams are ordered after the allocation (an event is recorded on `stream` for them,
    /// since a stream-ordered resource's memory exists there only from that point).
    ///
    /// On a capturing stream, a resource that
    /// [`allocates_in_graphs`](MemoryResource::allocates_in_graphs) (a stream-ordered pool)
    /// records a graph allocation node: such a buffer is scratch of that capture, and any use
    /// outside it is [`MemoryError::GraphAllocation`](crate::MemoryError::GraphAllocation)
    /// (PyTorch's `cudaMallocAsync` backend inside `torch.cuda.graph`).
    ///
    /// # Errors
    /// `ZeroLength`, `Misaligned` as for [`new_on`](Self::new_on); `WrongDevice` /
    /// `WrongContext` for a stream that is not of the resource's context; the resource's error.
    pub fn with_resource(
        resource: Arc<dyn MemoryResource>,
        len: usize,
        stream: &Stream,
    ) -> Result<Self> {
        const OPERATION: &str = "DeviceBuffer::with_resource";
        let bytes = allocation_bytes::<T>(OPERATION, len)?;
        check_stream(resource.device(), stream, OPERATION)?;
        if resource.context().as_raw() != stream.context().as_raw() {
            return Err(crate::MemoryError::WrongContext {
                operation: OPERATION,
                device: stream.device().ordinal(),
            });
        }
        // The tracker first: made after the allocation, its failure would lose the memory.
        let mut tracker = StreamTracker::new(resource.context())?;
        // On a capturing stream a graph-allocating resource records an allocation node: the
        // memory exists only while the graph's launch holds it, so only that capture's work
        // may use the buffer.
        if resource.allocates_in_graphs()
            && let Some(capture) = capturing_into(stream)?
        {
            tracker.set_graph_allocation(capture);
        }
        crate::caching::return_frees_deferred_by_captures();
        let ptr = resource.allocate_owned(bytes, stream)?;
        let buffer = Self {
            core: BufferCore::with_tracker(tracker, ptr, len, size_of::<T>()),
            memory: Memory::Resource {
                resource,
                ptr,
                bytes,
                home: stream.downgrade(),
            },
            _element: PhantomData,
        };
        // Other streams must not touch the memory before `stream` reaches the allocation.
        Part::whole(buffer.core.tracker()).record(OPERATION, stream, super::Access::Write)?;
        Ok(buffer)
    }

    /// A buffer over a block of a caching allocator, allocated for `stream`: its first use on
    /// another stream waits for `stream` ([`Origin`]), since the block's last buffer may have
    /// left unrecorded work queued there.
    #[inline]
    fn from_cached((grant, shard): (Grant, Arc<ShardHandle>), len: usize, stream: &Stream) -> Self {
        let block = CachedBlock::new(grant, stream);
        let tracker = StreamTracker::with_origin(Owner::Cache(shard), Origin::of(stream));
        Self {
            core: BufferCore::with_tracker(tracker, block.ptr(), len, size_of::<T>()),
            memory: Memory::Cached(block),
            _element: PhantomData,
        }
    }

    /// Allocates `len` elements set to zero (see [`new`](Self::new)).
    pub fn zeroed(context: &Arc<Context>, len: usize) -> Result<Self> {
        let mut buffer = Self::new(context, len)?;
        buffer.fill(T::zeroed())?;
        Ok(buffer)
    }

    /// Allocates a buffer holding a copy of `data` (see [`new`](Self::new)).
    ///
    /// # Errors
    /// `ZeroLength` for an empty slice.
    pub fn from_slice(context: &Arc<Context>, data: &[T]) -> Result<Self> {
        let mut buffer = Self::new(context, data.len())?;
        buffer.copy_from_host(data)?;
        Ok(buffer)
    }

    /// The stream the memory was allocated for, when it came from a caching allocator (its
    /// block returns to that stream's free list).
    pub fn allocated_for(&self) -> Option<StreamKey> {
        match &self.memory {
            Memory::Cached(block) => Some(block.stream()),
            _ => None,
        }
    }

    /// The bytes behind the buffer: the caching allocator's block (the request rounded up), or
    /// the resource's allocation.
    pub fn allocated_bytes(&self) -> usize {
        match &self.memory {
            Memory::Cached(block) => block.block_size(),
            Memory::Resource { bytes, .. } => *bytes,
            Memory::Freed => 0,
        }
    }

    /// The name of the resource the memory came from (`"caching"` for a caching allocator).
    pub fn resource_name(&self) -> &str {
        match &self.memory {
            Memory::Resource { resource, .. } => resource.name(),
            _ => "caching",
        }
    }
}

impl<T: Element> Sealed for DeviceBuffer<T> {
    #[inline]
    fn core(&self) -> CoreRef<'_> {
        self.core.as_ref()
    }
}

impl<T: Element> Buffer<T> for DeviceBuffer<T> {}

/// Deallocates a resource's memory on the stream it was allocated on (`home`), once that
/// stream has waited for the events of the uses on other streams, while that stream's handle
/// lives; else on the legacy default stream, after the handle's end ([`deallocate_after`]).
/// The work queued on the home stream by hand, which records nothing, is ordered before the
/// free either way. Only with no capture involved: during one the free is deferred
/// ([`release_resource_during_capture`](crate::caching::release_resource_during_capture)),
/// and a capture that begins meanwhile makes this a capture refusal, which the caller defers.
fn deallocate_on_home(
    resource: &dyn MemoryResource,
    ptr: DevicePtr,
    bytes: usize,
    events: &[StreamEvent],
    home: &WeakStream,
) -> Result<()> {
    // No capture may begin between the check and the free: a stream-ordered free queued on a
    // stream that began capturing would become a node of its graph.
    let on_home = home.with_no_capture_beginning(|stream| {
        // Beside another thread's capture the free is made as an eager one, unless the home
        // stream itself captures (the waits and a stream-ordered free would become nodes of
        // its graph): the events are eager (no capture used the buffer), and relaxed capture
        // mode keeps the waits and the free from breaking the other capture.
        if active_captures() != 0 {
            cuweave_driver::graph::refuse_recording(
                stream,
                cuweave_driver::graph::StatusCheck::Always,
                "DeviceBuffer::drop",
                "the buffer's home stream is capturing: its free would become a node of the graph",
            )?;
        }
        let _relaxed = cuweave_driver::graph::CaptureModeGuard::enter(
            cuweave_driver::graph::CaptureMode::Relaxed,
        )?;
        for StreamEvent { event, stream: id } in events {
            if *id == Some(stream.id()) {
                continue; // queued on the home stream: stream order covers it
            }
            if stream.wait_event(event).is_err() {
                event.synchronize()?;
            }
        }
        resource.deallocate_owned(ptr, bytes, stream)
    });
    match on_home {
        Some(freed) => freed,
        None => deallocate_after(resource, ptr, bytes, events, Some(home.end())),
    }
}

/// `Err(GraphError::Capturing)` while a capture is active.
fn refuse_if_capturing() -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    Err(crate::MemoryError::Driver(
        GraphError::Capturing {
            operation: "DeviceBuffer::drop",
            reason: "a capture began while the buffer was being freed",
        }
        .into(),
    ))
}

/// Deallocates a resource's memory that no capture used, as a drop with no capture active does:
/// on its `home` stream behind the events of the uses on other streams while that handle lives,
/// else on the legacy default stream after the handle's end (`None`: a context-relative stream,
/// after the events only). So the work queued on the home stream by hand, which records nothing,
/// is ordered before the free too. For a resource buffer whose free a capture deferred, returned
/// after it; a capture active or begun meanwhile makes this a capture refusal.
pub(crate) fn deallocate_eagerly_used(
    resource: &dyn MemoryResource,
    ptr: DevicePtr,
    bytes: usize,
    events: &[StreamEvent],
    home: Option<&WeakStream>,
) -> Result<()> {
    match home {
        Some(home) => deallocate_on_home(resource, ptr, bytes, events, home),
        None => {
            refuse_if_capturing()?;
            deallocate_after(resource, ptr, bytes, events, None)
        }
    }
}

/// Deallocates a resource's memory on the legacy default stream once it has waited for the end
/// of the stream the memory was allocated on (`end`, when that handle is gone) and for every
/// event; if a wait cannot be queued, the event is waited for on the host instead.
fn deallocate_after(
    resource: &dyn MemoryResource,
    ptr: DevicePtr,
    bytes: usize,
    events: &[StreamEvent],
    end: Option<&StreamEnd>,
) -> Result<()> {
    let legacy = legacy_stream(resource.context());
    if let Some(end) = end
        && !end.wait_on(&legacy)?
    {
        // No event could be recorded at the handle's drop: only the device's end covers the
        // work it queued.
        refuse_if_capturing()?;
        resource.context().synchronize()?;
    }
    for StreamEvent { event, .. } in events {
        if legacy.wait_event(event).is_err() {
            event.synchronize()?;
        }
    }
    resource.deallocate_owned(ptr, bytes, &legacy)
}

/// Frees a graph allocation dropped inside the capture that allocates it with a free node of
/// that graph: on its home stream, once that stream has joined every captured use (the events
/// recorded in the capture, which a capturing stream waits for as graph edges). So each replay
/// allocates and frees it, and the graph may be launched again, as PyTorch's `del tmp` inside
/// `torch.cuda.graph` does with the `cudaMallocAsync` backend. `None`, nothing done, when the
/// home stream is gone or no longer records into that capture.
fn free_in_own_capture(
    resource: &dyn MemoryResource,
    ptr: DevicePtr,
    bytes: usize,
    events: &[StreamEvent],
    home: &WeakStream,
    capture: u64,
) -> Option<Result<()>> {
    home.with(|stream| {
        match stream.capture_status() {
            Ok(status) if status.id() == Some(capture) => {}
            _ => return None,
        }
        for StreamEvent { event, stream: id } in events {
            if *id == Some(stream.id()) {
                continue; // recorded on the home stream: capture order covers it
            }
            if let Err(error) = stream.wait_event(event) {
                return Some(Err(error.into()));
            }
        }
        Some(resource.deallocate_owned(ptr, bytes, stream))
    })
    .flatten()
}

/// The capture `stream` records into, if any (one atomic load while none is active).
fn capturing_into(stream: &Stream) -> Result<Option<u64>> {
    if cuweave_driver::graph::active_captures() == 0 {
        return Ok(None);
    }
    Ok(stream.capture_status()?.id())
}

impl<T: Element> Drop for DeviceBuffer<T> {
    #[inline]
    fn drop(&mut self) {
        // Every use's event travels with the block, its own stream's too: the next buffer made
        // from it starts with an empty tracker and may be used on any stream.
        let markers = self.core.tracker_mut().take_for_free();
        match std::mem::replace(&mut self.memory, Memory::Freed) {
            Memory::Cached(block) => match self.core.tracker().shard() {
                Some(shard) => {
                    if let Err(error) = block.free(shard, markers) {
                        tracing::error!(%error, "returning a DeviceBuffer's block to its allocator failed");
                    }
                }
                None => {
                    tracing::error!("a cached DeviceBuffer lost its allocator; its block is leaked")
                }
            },
            Memory::Resource {
                resource,
                ptr,
                bytes,
                home,
            } => {
                let freed = || match &home {
                    Some(home) => deallocate_on_home(&*resource, ptr, bytes, &markers.events, home),
                    None => deallocate_after(&*resource, ptr, bytes, &markers.events, None),
                };
                let own_capture = self.core.tracker().graph_allocation_of();
                if let (Some(capture), Some(home)) = (own_capture, &home) {
                    match free_in_own_capture(
                        &*resource,
                        ptr,
                        bytes,
                        &markers.events,
                        home,
                        capture,
                    ) {
                        Some(Ok(())) => return,
                        Some(Err(error)) => {
                            tracing::warn!(%error, ptr, bytes, "freeing a graph allocation inside its capture failed; it is held for its graphs instead");
                        }
                        None => {}
                    }
                }
                if markers.used_in_graphs() || (active_captures() != 0 && home.is_none()) {
                    // Graph memory, or beside a capture with no home stream to free on: no
                    // wait nor query may run (one on a captured event fails, one on an eager
                    // event breaks a global-mode capture).
                    crate::caching::release_resource_during_capture(
                        resource, ptr, bytes, home, markers,
                    );
                } else if let Err(error) = freed() {
                    if error.is_capture_refusal() {
                        // A capture began on another thread after the check above: it was seen
                        // before the free was queued, or the resource refused the free (a
                        // `CachingResource` refuses cross-stream frees during a capture) and
                        // kept the allocation: it waits with the frees made during a capture,
                        // for the first flush with none active.
                        crate::caching::release_resource_during_capture(
                            resource, ptr, bytes, home, markers,
                        );
                    } else {
                        tracing::error!(%error, ptr, bytes, "deallocating a DeviceBuffer failed; the memory is leaked");
                    }
                }
            }
            Memory::Freed => {}
        }
    }
}
