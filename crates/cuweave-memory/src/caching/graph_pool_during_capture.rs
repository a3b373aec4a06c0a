//! The caching allocator while a capture is active: allocations routed to the capture's graph
//! pool, frees that would record or poll events deferred or held for the pools' graphs, and
//! the operations a capture refuses.

use std::sync::Arc;

use cuweave_driver::Stream;
use cuweave_driver::graph::{
    CaptureMode, CaptureModeGuard, GraphError, active_captures, capture_state,
    known_complete_before,
};
use cuweave_driver::stream::WeakStream;

use super::super::allocator::{CachingAllocator, ShardHandle};
use super::super::block::BlockId;
use super::super::engine::{Adoption, Upstream};
use super::super::pool::{Grant, Segment};
use super::super::stream_uses::StreamKey;
use super::binding::{MissPolicy, capturing_pool_of, route};
use super::held::{
    EagerUses, Held, HeldBlock, HeldMemory, defer, flush_deferred, hold_for_captures,
};
use super::{PRIVATE_BIT, is_retained, private_key};
use crate::buffer::tracker::FreeMarkers;
use crate::error::{MemoryError, Result};
use crate::resource::MemoryResource;

/// An upstream for segments taken during a capture: on the allocator's own stream, which never
/// captures, with the thread in relaxed mode, and finished before the segment is handed out
/// (a stream-ordered upstream's allocation must be complete before other streams use it).
struct CaptureUpstream<'a> {
    allocator: &'a CachingAllocator,
}

impl super::super::engine::Release for CaptureUpstream<'_> {
    fn release_segments(&self, _segments: &[Segment]) -> Result<()> {
        Err(MemoryError::Driver(
            GraphError::Capturing {
                operation: "CachingAllocator (release)",
                reason: "returning memory to the driver during a capture would break it",
            }
            .into(),
        ))
    }
}

impl Upstream for CaptureUpstream<'_> {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        let shared = self.allocator.shared();
        let _relaxed = CaptureModeGuard::enter(CaptureMode::Relaxed)?;
        let side = shared.release_stream()?;
        let ptr = shared.upstream().allocate_owned(bytes, side)?;
        side.synchronize()?;
        Ok(ptr)
    }
}

impl CachingAllocator {
    /// [`allocate_grant`](Self::allocate_grant) while some capture is active in the process;
    /// `key` is the stream's own (checked) key.
    #[cold]
    #[inline(never)]
    pub(in crate::caching) fn allocate_during_capture(
        &self,
        bytes: usize,
        stream: &Stream,
        key: StreamKey,
    ) -> Result<(Grant, Arc<ShardHandle>)> {
        let (key, misses, private) = match route(stream)? {
            Some((pool, misses)) => (private_key(pool, stream), misses, true),
            None => (key, MissPolicy::AllocateRelaxed, false),
        };
        let upstream = CaptureUpstream { allocator: self };
        let shared = self.shared();
        let retired = |key: StreamKey| key.as_usize() & PRIVATE_BIT != 0 && !is_retained(key);
        let epoch = || capture_state().epoch;
        // 0 (adopt nothing) for a capture begun without the synchronisation, or on another
        // context: the device may still be using the dead pools' segments.
        let complete_before = || match stream.capture_status() {
            Ok(status) => status.id().map_or(0, |capture| {
                known_complete_before(capture, shared.context())
            }),
            Err(_) => 0,
        };
        let adoption = Adoption {
            retired: &retired,
            epoch: &epoch,
            complete_before: &complete_before,
        };
        let grant = shared.engine.allocate_quiet(
            key,
            bytes,
            &upstream,
            misses == MissPolicy::AllocateRelaxed,
            private.then_some(&adoption),
        )?;
        Ok((grant, self.shard_handle(key)))
    }
}

/// Frees a block while some capture is active; see the module documentation.
#[cold]
#[inline(never)]
pub(in crate::caching) fn release_during_capture(
    shard: &Arc<ShardHandle>,
    id: BlockId,
    ptr: u64,
    stream: StreamKey,
    uses: Vec<Arc<Stream>>,
) -> Result<()> {
    let engine = &shard.shared.engine;
    let held = |after_device| HeldBlock {
        shared: Arc::clone(&shard.shared),
        id,
        ptr,
        stream,
        uses: uses.clone(),
        after_device,
    };
    if stream.as_usize() & PRIVATE_BIT != 0 {
        if uses.is_empty() {
            return engine.free(stream, id, ptr);
        }
        defer(held(false).into());
        return Ok(());
    }
    let owner = capturing_pool_of(stream.as_usize() as u64)
        .or_else(|| uses.iter().find_map(|used| capturing_pool_of(used.id())));
    if let Some(pool) = owner {
        pool.token.held.lock().push(held(true).into());
        return Ok(());
    }
    // A borrowed stream's key may name a new stream at the old address by the time the block
    // is reused (see `StreamKey`): no event can be recorded now, so its free waits for the
    // device instead, once no capture is active.
    let borrowed = stream.is_borrowed();
    if uses.is_empty() && !borrowed {
        return engine.free(stream, id, ptr);
    }
    defer(held(borrowed).into());
    Ok(())
}

/// Frees a typed buffer's block while some capture is active, or one that a capture used
/// (`markers.graph_pools`: the tags of the pools of those captures, ended ones too, whose graphs
/// may replay with it). Its events may have been
/// recorded inside a capture (they can never be queried), so none is waited on or polled: they
/// go back to the context's event pool (whoever takes one records it again before using it),
/// and a block that was used is held instead of freed.
///
/// - A block of the general cache used by captures is graph memory: it is held by the pools
///   bound to those captures (until the last of them dies), or, when one of them has no known
///   pool (a raw capture), kept out of the cache for the process's life
///   ([`stranded_graph_memory`]).
/// - A private block waits for the captures to end (its uses may be on streams forked into
///   the capture, not ordered with the next allocation).
/// - A general-cache block used only eagerly is held by the pool of a capture that has its
///   stream, else freed behind its uses' events (recorded eagerly) as an eager free is: the
///   pending poll asks them in relaxed capture mode while a capture is active, so the block is
///   reused during the capture once they have completed. On a borrowed stream it waits for the
///   device once no capture is active.
///
/// [`stranded_graph_memory`]: crate::caching::stranded_graph_memory
#[cold]
#[inline(never)]
pub(crate) fn release_block_during_capture(
    shard: &ShardHandle,
    id: BlockId,
    ptr: u64,
    bytes: usize,
    stream: StreamKey,
    markers: FreeMarkers,
) -> Result<()> {
    let engine = &shard.shared.engine;
    let FreeMarkers {
        events,
        graph_pools,
    } = markers;
    let used = !events.is_empty();
    let private = stream.as_usize() & PRIVATE_BIT != 0;
    let held = HeldBlock {
        shared: Arc::clone(&shard.shared),
        id,
        ptr,
        stream,
        uses: Vec::new(),
        after_device: !private,
    };
    if !private && !graph_pools.is_empty() {
        drop(events);
        hold_for_captures(held.into(), &graph_pools, bytes);
        flush_deferred();
        return Ok(());
    }
    // A borrowed stream's key may name a new stream at the old address by the time the block
    // is reused (see `StreamKey`): its free waits for the device, as a used block's does.
    if !used && !stream.is_borrowed() {
        return engine.free(stream, id, ptr);
    }
    if !private {
        if let Some(pool) = capturing_pool_of(stream.as_usize() as u64) {
            drop(events);
            pool.token.held.lock().push(held.into());
            return Ok(());
        }
        // No capture used it (`graph_pools` is empty) and none has its stream: its events were
        // recorded eagerly, so it waits behind them as any eager free does, and is reused once
        // they have completed (the pending poll asks in relaxed capture mode while a capture is
        // active), so a loader freeing beside a long capture on another thread stays bounded. A
        // borrowed stream's key may name another stream by then: that block waits for the
        // device instead, once no capture is active.
        if !stream.is_borrowed() {
            if events.is_empty() {
                return engine.free(stream, id, ptr);
            }
            return engine.free_after(stream, id, ptr, events);
        }
        drop(events);
    }
    defer(held.into());
    flush_deferred();
    Ok(())
}

/// Frees a resource's allocation (a typed buffer not from a caching allocator) while some
/// capture is active, or after one that used it: nothing is waited on or queried. Used by
/// captures, it is held as [`release_block_during_capture`] holds a general-cache block; else
/// it is deallocated once no capture is active, as an eager drop would be: on its `home` stream
/// behind its uses' events (the first allocation after the captures ended does it,
/// [`return_frees_deferred_by_captures`](super::held::return_frees_deferred_by_captures)).
#[cold]
#[inline(never)]
pub(crate) fn release_resource_during_capture(
    resource: Arc<dyn MemoryResource>,
    ptr: u64,
    bytes: usize,
    home: Option<WeakStream>,
    markers: FreeMarkers,
) {
    let FreeMarkers {
        events,
        graph_pools,
    } = markers;
    // With no capture among its uses, its events were recorded eagerly: once no capture is
    // active it is deallocated as an eager drop does, on its home stream behind them (so the
    // work queued there by hand is covered too), not after the device. Else it is graph memory.
    let eager = graph_pools.is_empty().then_some(EagerUses { events, home });
    let held = Held {
        memory: HeldMemory::Resource {
            resource,
            ptr,
            bytes,
            eager,
        },
        also: Vec::new(),
    };
    if graph_pools.is_empty() {
        defer(held);
    } else {
        hold_for_captures(held, &graph_pools, bytes);
    }
    flush_deferred();
}

/// Refuses an operation of the allocator that would wait for the device or free memory while
/// a capture is active.
pub(in crate::caching) fn refuse_during_capture(operation: &'static str) -> Result<()> {
    if active_captures() == 0 {
        return Ok(());
    }
    Err(MemoryError::Driver(
        GraphError::Capturing {
            operation,
            reason: "it waits for the device and returns memory to the driver",
        }
        .into(),
    ))
}
