//! Memory freed during or after captures whose return waits: held by graph pools for their
//! graphs, deferred until no capture is active, or stranded for good; and its return.

#[cfg(test)]
use std::sync::atomic::Ordering;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Weak};

use cuweave_driver::graph::active_captures;
use cuweave_driver::stream::WeakStream;
use cuweave_driver::{Context, Stream};
use parking_lot::Mutex;

use super::super::allocator::Shared;
use super::super::block::BlockId;
use super::super::stream_uses::{StreamKey, record_uses};
#[cfg(test)]
use super::test_support;
use super::{NO_POOL, PoolToken, pool_of_tag};
use crate::error::Result;
use crate::events::StreamEvent;
use crate::resource::MemoryResource;

/// A block freed during a capture whose return waits: for the capture to end (events to
/// record), or for its pool to die (graph memory of the general cache).
pub(super) struct HeldBlock {
    pub(super) shared: Arc<Shared>,
    pub(super) id: BlockId,
    pub(super) ptr: u64,
    pub(super) stream: StreamKey,
    pub(super) uses: Vec<Arc<Stream>>,
    /// Whether the device must be idle first (the graph may still be replaying with it).
    pub(super) after_device: bool,
}

/// Memory whose return waits for captures to end or for pools to die.
pub(super) enum HeldMemory {
    /// A block of a caching allocator.
    Block(HeldBlock),
    /// An allocation of another memory resource: when a capture used it, deallocated (on the
    /// legacy stream) once the device has finished with it; else as an eager drop does
    /// (`eager`).
    Resource {
        resource: Arc<dyn MemoryResource>,
        ptr: u64,
        bytes: usize,
        /// When no capture used it: what an eager drop would wait for, instead of the device.
        eager: Option<EagerUses>,
    },
    /// Memory of another kind (a pinned pool's block, a managed allocation), which says itself
    /// how it goes back.
    Other(Box<dyn GraphHeld>),
    /// Counts its return (tests).
    #[cfg(test)]
    Probe(Arc<std::sync::atomic::AtomicUsize>),
    /// Counts its return, which waits for nothing on the host, as a typed block's behind its
    /// eager events does (tests).
    #[cfg(test)]
    LazyProbe(Arc<std::sync::atomic::AtomicUsize>),
}

/// Memory other than the caching allocator's blocks and resources' allocations (a pinned pool's
/// block, a managed allocation) that graph pools hold for their graphs as they hold blocks
/// ([`hold_for_graphs`]).
pub(crate) trait GraphHeld: Send {
    /// Returns the memory, once no graph can use it any more (every pool that held it has died)
    /// and no capture is active: the device must have finished first (a graph launch may still
    /// run), so this synchronises the memory's context through [`synchronize_once`] (once per
    /// flush: `synced` lists the contexts already synchronised). When the synchronisation is
    /// refused because a capture began meanwhile (another thread's, after the flush checked),
    /// the memory comes back (`Ok(Some(self))`), to be returned once no capture is active. On
    /// any other failure the memory must be kept out of use as [`strand`](Self::strand) keeps it.
    ///
    /// # Errors
    /// The driver's error when the context cannot be synchronised.
    fn give_back(
        self: Box<Self>,
        synced: &mut Vec<Arc<Context>>,
    ) -> Result<Option<Box<dyn GraphHeld>>>;

    /// Keeps the memory out of use for good: a capture with no graph pool used it, so a graph
    /// of that capture may replay with it for as long as the process runs.
    fn strand(self: Box<Self>);
}

/// Held memory, and the other pools whose graphs may still use it: when the pool holding it
/// dies it passes to one of those still alive, and returns only once none is.
pub(super) struct Held {
    pub(super) memory: HeldMemory,
    pub(super) also: Vec<Weak<PoolToken>>,
}

/// The uses of a resource allocation no capture used, freed while one was active: the events
/// recorded behind its uses (all eager) and the stream it was allocated on, where the
/// deallocation goes once no capture is active (covering work queued there by hand, which
/// records no event), as [`crate::buffer::deallocate_eagerly_used`] does for an eager drop.
pub(super) struct EagerUses {
    pub(super) events: Vec<StreamEvent>,
    pub(super) home: Option<WeakStream>,
}

impl From<HeldBlock> for Held {
    fn from(block: HeldBlock) -> Self {
        Self {
            memory: HeldMemory::Block(block),
            also: Vec::new(),
        }
    }
}

/// Frees waiting for no capture to be active whose return waits for the device (a
/// synchronisation): carried out by [`flush_deferred`], at the points that may wait.
static DEFERRED: Mutex<Vec<Held>> = Mutex::new(Vec::new());
/// Frees waiting for no capture to be active whose return waits for nothing on the host (their
/// uses' events are recorded or kept): carried out by [`flush_deferred`] and, lazily, by the
/// first allocation or resource buffer made once no capture is active
/// ([`return_frees_deferred_by_captures`]), as PyTorch's allocator inserts the events of frees
/// deferred during a capture at its next `malloc`.
static AFTER_CAPTURES: Mutex<Vec<Held>> = Mutex::new(Vec::new());
/// Whether [`AFTER_CAPTURES`] may hold anything: set by every push, cleared by the take that
/// empties it (under its lock), so the allocation path pays one load.
static AFTER_CAPTURES_WAITING: AtomicBool = AtomicBool::new(false);

impl Held {
    /// Whether the return waits for nothing on the host.
    fn waits_for_nothing(&self) -> bool {
        match &self.memory {
            HeldMemory::Block(block) => !block.after_device,
            HeldMemory::Resource { eager, .. } => eager.is_some(),
            #[cfg(test)]
            HeldMemory::LazyProbe(_) => true,
            _ => false,
        }
    }
}

/// Defers `held` until no capture is active (see [`DEFERRED`] and [`AFTER_CAPTURES`]).
pub(super) fn defer(held: Held) {
    if held.waits_for_nothing() {
        let mut waiting = AFTER_CAPTURES.lock();
        waiting.push(held);
        AFTER_CAPTURES_WAITING.store(true, AtomicOrdering::Release);
    } else {
        DEFERRED.lock().push(held);
    }
}

/// Carries out the frees deferred by captures that wait for nothing on the host, once no
/// capture is active: one atomic load when there are none. Called where memory is allocated
/// (the caching allocator's allocation, a resource buffer's), so memory freed during a
/// capture comes back after it ends without waiting for another capture or `empty_cache`.
#[inline]
pub(crate) fn return_frees_deferred_by_captures() {
    if AFTER_CAPTURES_WAITING.load(AtomicOrdering::Acquire) && active_captures() == 0 {
        return_after_captures();
    }
}

#[cold]
#[inline(never)]
fn return_after_captures() {
    let taken = {
        let mut waiting = AFTER_CAPTURES.lock();
        AFTER_CAPTURES_WAITING.store(false, AtomicOrdering::Release);
        std::mem::take(&mut *waiting)
    };
    let mut synced: Vec<Arc<Context>> = Vec::new();
    for held in taken {
        if let Err(error) = return_block(held, &mut synced) {
            tracing::error!(%error, "returning memory freed during a capture failed; it is never reused");
        }
    }
}
/// Allocations used by a capture no pool could be found for, kept out of every cache for the
/// process's life (a graph of that capture may still write them): how many, and their bytes.
static STRANDED: Mutex<(u64, u64)> = Mutex::new((0, 0));

/// The live pools among `tags` (of the captures that used some memory), whose graphs may use
/// it: `None` when one capture had no pool ([`NO_POOL`]). A pool that has died needs nothing
/// (no graph of it is left).
fn pools_of(tags: &[u64]) -> Option<Vec<Arc<PoolToken>>> {
    let mut pools: Vec<Arc<PoolToken>> = Vec::new();
    for &tag in tags {
        if tag == NO_POOL {
            return None;
        }
        if let Some(token) = pool_of_tag(tag)
            && !pools.iter().any(|pool| pool.id == token.id)
        {
            pools.push(token);
        }
    }
    Some(pools)
}

/// Holds `held` (used by the captures of the pools `tags`) for their graphs: in the live
/// pools, deferred when all of them have died, or stranded for good when a capture had no pool.
pub(super) fn hold_for_captures(mut held: Held, tags: &[u64], bytes: usize) {
    match pools_of(tags) {
        Some(mut pools) => match pools.pop() {
            Some(first) => {
                held.also = pools.iter().map(Arc::downgrade).collect();
                first.held.lock().push(held);
            }
            None => defer(held),
        },
        None => {
            tracing::warn!(
                bytes,
                "memory used by a capture with no graph pool is kept out of every cache for good"
            );
            {
                let mut stranded = STRANDED.lock();
                stranded.0 += 1;
                stranded.1 += bytes as u64;
            }
            match held.memory {
                HeldMemory::Other(other) => other.strand(),
                // Never returned: forgetting keeps the block allocated (and counted in the
                // allocator's statistics) and the resource's memory untouched.
                memory => std::mem::forget(memory),
            }
        }
    }
}

/// Allocations freed after a capture used them that no graph pool could hold (a capture begun
/// without [`begin_allocate_to_pool`]): a graph of that capture may still use them, so they are
/// never reused nor released. How many, and their bytes, since the process started: blocks of
/// caching allocators, allocations of other memory resources, and the pinned-pool blocks and
/// managed allocations of typed buffers.
///
/// [`begin_allocate_to_pool`]: crate::caching::begin_allocate_to_pool
pub fn stranded_graph_memory() -> (u64, u64) {
    *STRANDED.lock()
}

/// Carries out deferred frees once no capture is active (else leaves them for the last
/// capture's end).
pub(in crate::caching) fn flush_deferred() {
    if active_captures() != 0 {
        return;
    }
    let mut taken = std::mem::take(&mut *DEFERRED.lock());
    {
        let mut waiting = AFTER_CAPTURES.lock();
        AFTER_CAPTURES_WAITING.store(false, AtomicOrdering::Release);
        taken.append(&mut waiting);
    }
    if taken.is_empty() {
        return;
    }
    let mut synced: Vec<Arc<Context>> = Vec::new();
    for block in taken {
        if let Err(error) = return_block(block, &mut synced) {
            tracing::error!(%error, "returning a block freed during a capture failed; it is never reused");
        }
    }
}

/// Whether a capture is active now (in tests, also one faked on the calling thread).
fn capture_active_now() -> bool {
    #[cfg(test)]
    if test_support::FAKE_CAPTURE.with(std::cell::Cell::get) {
        return true;
    }
    active_captures() != 0
}

/// Returns held memory; memory whose return a capture begun since the flush's check refused
/// is deferred again ([`defer`]), for the next flush or allocation with no capture active.
pub(super) fn return_block(held: Held, synced: &mut Vec<Arc<Context>>) -> Result<()> {
    // A capture begun since the flush checked, seen before each item: after a context's first
    // item `synced` skips its synchronisation, the one call that would have been refused, so a
    // resource would be freed (`cuMemFree`) or events recorded into a capturing stream.
    if capture_active_now() {
        defer(held);
        return Ok(());
    }
    // The device must finish first: a capture begun since the check refuses the wait.
    let context = match &held.memory {
        HeldMemory::Block(block) if block.after_device => Some(Arc::clone(block.shared.context())),
        HeldMemory::Resource {
            resource,
            eager: None,
            ..
        } => Some(Arc::clone(resource.context())),
        _ => None,
    };
    if let Some(context) = context {
        match synchronize_once(&context, synced) {
            Err(error) if error.is_capture_refusal() => {
                defer(held);
                return Ok(());
            }
            Err(error) => return Err(error),
            Ok(()) => {}
        }
    }
    let block = match held.memory {
        HeldMemory::Block(block) => block,
        HeldMemory::Resource {
            resource,
            ptr,
            bytes,
            eager,
        } => {
            let result = match &eager {
                Some(EagerUses { events, home }) => crate::buffer::deallocate_eagerly_used(
                    &*resource,
                    ptr,
                    bytes,
                    events,
                    home.as_ref(),
                ),
                None => {
                    let legacy = crate::buffer::raw::legacy_stream(resource.context());
                    resource.deallocate_owned(ptr, bytes, &legacy)
                }
            };
            return redefer_refused(result, || Held {
                memory: HeldMemory::Resource {
                    resource,
                    ptr,
                    bytes,
                    eager,
                },
                also: held.also,
            });
        }
        HeldMemory::Other(other) => {
            if let Some(again) = other.give_back(synced)? {
                defer(Held {
                    memory: HeldMemory::Other(again),
                    also: held.also,
                });
            }
            return Ok(());
        }
        #[cfg(test)]
        HeldMemory::Probe(count) | HeldMemory::LazyProbe(count) => {
            count.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
    };
    let engine = &block.shared.engine;
    if block.after_device {
        return engine.free(block.stream, block.id, block.ptr);
    }
    let shared = &block.shared;
    match record_uses(&block.uses, shared.context(), &shared.events) {
        Ok(events) => engine.free_after(block.stream, block.id, block.ptr, events),
        Err(error) => {
            engine.free_never_reuse(block.stream, block.id, block.ptr)?;
            Err(error)
        }
    }
}

/// The result of returning held memory, with a refusal because a capture began since the
/// flush checked (a `CachingResource` refuses a cross-stream free during a capture) turned into
/// a deferral: `again` is deferred again ([`defer`]), for the next flush or allocation with no
/// capture active, instead of the memory never being freed.
pub(super) fn redefer_refused(result: Result<()>, again: impl FnOnce() -> Held) -> Result<()> {
    match result {
        Err(error) if error.is_capture_refusal() => {
            tracing::debug!(%error, "returning held memory was refused by a capture; deferred");
            defer(again());
            Ok(())
        }
        other => other,
    }
}

/// Holds `memory`, freed after captures used it (`graph_pools`: the tags of their pools, as
/// [`FreeMarkers::graph_pools`] gives them; never empty), for their graphs, as a block of the
/// general cache is held: by the pools still alive, returned ([`GraphHeld::give_back`]) once
/// the last of them has died and no capture is active, at once (after synchronising) when all
/// have died already, and stranded ([`GraphHeld::strand`], counted in
/// [`stranded_graph_memory`]) when one of the captures had no pool.
///
/// [`FreeMarkers::graph_pools`]: crate::buffer::tracker::FreeMarkers::graph_pools
pub(crate) fn hold_for_graphs(memory: Box<dyn GraphHeld>, graph_pools: &[u64], bytes: usize) {
    let held = Held {
        memory: HeldMemory::Other(memory),
        also: Vec::new(),
    };
    hold_for_captures(held, graph_pools, bytes);
    flush_deferred();
}

/// Returns `memory` ([`GraphHeld::give_back`]) once no capture is active: at once when none is
/// now, else when the last active one ends. For memory no capture used, freed while one is
/// active (when nothing may wait for the device).
pub(crate) fn defer_until_no_capture(memory: Box<dyn GraphHeld>) {
    defer(Held {
        memory: HeldMemory::Other(memory),
        also: Vec::new(),
    });
    flush_deferred();
}

/// Synchronises `context` unless `synced` says it already was.
pub(crate) fn synchronize_once(
    context: &Arc<Context>,
    synced: &mut Vec<Arc<Context>>,
) -> Result<()> {
    if !synced.iter().any(|done| Arc::ptr_eq(done, context)) {
        context.synchronize()?;
        synced.push(Arc::clone(context));
    }
    Ok(())
}
