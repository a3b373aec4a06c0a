//! Captures bound to graph pools ([`begin_allocate_to_pool`]): which pool a capture's
//! allocations go to, which streams take part in it, and the pools of captures that have
//! ended, for the buffers they used.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use cuweave_driver::Stream;
use cuweave_driver::graph::GraphError;
use parking_lot::{Mutex, RwLock};

use super::held::flush_deferred;
use super::{GraphPool, NO_POOL};
use crate::error::{MemoryError, Result};

/// What a capture's miss in its private pool does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MissPolicy {
    /// Take a new segment from the upstream, with the thread in relaxed capture mode for that
    /// one call (the allocation is not recorded into the graph).
    #[default]
    AllocateRelaxed,
    /// Fail with [`GraphError::Capturing`]: the capture must find everything it needs in the
    /// pool (warmed by an earlier capture or eager run into the same pool).
    Fail,
}

/// The tag of the graph pool the capture `capture` is bound to, for a buffer to remember:
/// [`NO_POOL`] when none is. A capture whose binding ended is found among the last
/// [`ENDED_KEPT`] bindings to end (a use recorded before its capture was bound is resolved at
/// the buffer's next record or free, which may come after the capture ended).
pub(crate) fn pool_tag_of_capture(capture: u64) -> u64 {
    if let Some(binding) = BINDINGS
        .read()
        .iter()
        .find(|binding| binding.capture == capture)
    {
        return u64::from(binding.pool.token.id);
    }
    ENDED
        .lock()
        .iter()
        .rev()
        .find(|(ended, _)| *ended == capture)
        .map_or(NO_POOL, |&(_, tag)| tag)
}

/// Binds `capture` to `pool`. A capture bound to `pool` already stays bound (its policy is
/// updated, its streams kept) and counts one more guard: it is unbound when the last of its
/// guards drops (PyTorch's nested `beginAllocateToPool` / `endAllocateToPool`, as a library
/// called inside a capture does). One bound to another pool is refused: the capture's graph keeps
/// only the pool it was bound to, and buffers used after a rebind would name a pool the graph
/// does not keep alive (their memory freed under a graph that replays into it).
pub(super) fn bind_capture(
    capture: u64,
    pool: &GraphPool,
    misses: MissPolicy,
    streams: Vec<u64>,
) -> Result<()> {
    let mut bindings = BINDINGS.write();
    if let Some(binding) = bindings
        .iter_mut()
        .find(|binding| binding.capture == capture)
    {
        if !Arc::ptr_eq(&binding.pool.token, &pool.token) {
            return Err(MemoryError::CaptureBoundToAnotherPool {
                operation: "begin_allocate_to_pool",
                capture,
                bound: binding.pool.id(),
                requested: pool.id(),
            });
        }
        binding.misses = misses;
        binding.guards += 1;
        for stream in streams {
            if !binding.streams.contains(&stream) {
                binding.streams.push(stream);
            }
        }
    } else {
        bindings.push(Binding {
            capture,
            pool: pool.clone(),
            misses,
            streams,
            guards: 1,
        });
    }
    EPOCH.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// One capture bound to a pool.
pub(super) struct Binding {
    pub(super) capture: u64,
    pub(super) pool: GraphPool,
    misses: MissPolicy,
    /// Ids of the streams seen in the capture (its origin, streams forked into it).
    streams: Vec<u64>,
    /// The [`AllocateToPool`] guards alive for it: the binding ends when the last one drops.
    guards: usize,
}

pub(super) static BINDINGS: RwLock<Vec<Binding>> = RwLock::new(Vec::new());
/// Bumped whenever a binding comes or goes, so per-thread route caches know to look again.
static EPOCH: AtomicU64 = AtomicU64::new(0);
/// How many ended bindings [`pool_tag_of_capture`] still finds.
const ENDED_KEPT: usize = 1024;
/// The last [`ENDED_KEPT`] bindings to end: (capture, pool tag), oldest first.
static ENDED: Mutex<std::collections::VecDeque<(u64, u64)>> =
    Mutex::new(std::collections::VecDeque::new());

thread_local! {
    /// The last route this thread took during a capture: (epoch, stream id, pool, policy).
    static ROUTE: std::cell::Cell<Option<(u64, u64, u32, MissPolicy)>> =
        const { std::cell::Cell::new(None) };
}

/// A capture's allocations routed to a pool, until dropped (PyTorch's
/// `beginAllocateToPool` / `endAllocateToPool`).
///
/// Drop it after the capture has ended: frees deferred during the capture are then carried out.
#[must_use = "allocations stop going to the pool when the guard is dropped"]
pub struct AllocateToPool {
    pub(super) capture: u64,
    pub(super) pool: GraphPool,
}

impl fmt::Debug for AllocateToPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AllocateToPool")
            .field("capture", &self.capture)
            .field("pool", &self.pool.id())
            .finish()
    }
}

impl AllocateToPool {
    /// The pool.
    pub fn pool(&self) -> &GraphPool {
        &self.pool
    }

    /// The capture sequence's id.
    pub fn capture_id(&self) -> u64 {
        self.capture
    }
}

impl Drop for AllocateToPool {
    fn drop(&mut self) {
        let mut ended = None;
        let mut bindings = BINDINGS.write();
        bindings.retain_mut(|binding| {
            if binding.capture != self.capture {
                return true;
            }
            binding.guards = binding.guards.saturating_sub(1);
            if binding.guards > 0 {
                return true;
            }
            ended = Some(u64::from(binding.pool.token.id));
            false
        });
        if let Some(tag) = ended {
            // Under the bindings' lock, so that `pool_tag_of_capture` (which reads the
            // bindings, lets go, then locks the ended list) finds the capture in one or the
            // other, never neither: a NO_POOL there strands a buffer for good. ENDED is only
            // ever taken inside BINDINGS, never the other way round.
            let mut ended_list = ENDED.lock();
            if ended_list.len() == ENDED_KEPT {
                ended_list.pop_front();
            }
            ended_list.push_back((self.capture, tag));
        }
        EPOCH.fetch_add(1, Ordering::AcqRel);
        // Before the flush: a returned block can drop a pool, whose drop takes the lock.
        drop(bindings);
        flush_deferred();
    }
}

/// Routes the allocations of the capture `stream` is in to `pool`, until the guard drops.
///
/// # Errors
/// [`GraphError::NotCapturing`] when `stream` is not capturing;
/// [`MemoryError::CaptureBoundToAnotherPool`] when its capture is bound to another pool (the
/// binding is left as it was; binding the same pool again is fine, and nests: the capture stays
/// bound until its last guard drops); the driver's error when its capture status cannot be read.
pub fn begin_allocate_to_pool(
    stream: &Stream,
    pool: &GraphPool,
    misses: MissPolicy,
) -> Result<AllocateToPool> {
    let Some(capture) = stream.capture_status()?.id() else {
        return Err(MemoryError::Driver(
            GraphError::NotCapturing {
                operation: "begin_allocate_to_pool",
                stream: stream.id(),
            }
            .into(),
        ));
    };
    bind_capture(capture, pool, misses, vec![stream.id()])?;
    Ok(AllocateToPool {
        capture,
        pool: pool.clone(),
    })
}

/// Where `stream` stands with the bound captures.
enum Enlisted {
    /// Not capturing.
    NotCapturing,
    /// Capturing into a capture no pool is bound to.
    Unbound,
    /// Capturing into a bound capture, now listed among its streams.
    Bound(GraphPool, MissPolicy),
}

/// Finds the bound capture `stream` is in and lists the stream among its streams.
fn enlist(stream: &Stream) -> Result<Enlisted> {
    let Some(capture) = stream.capture_status()?.id() else {
        return Ok(Enlisted::NotCapturing);
    };
    let mut bindings = BINDINGS.write();
    let Some(binding) = bindings
        .iter_mut()
        .find(|binding| binding.capture == capture)
    else {
        return Ok(Enlisted::Unbound);
    };
    if !binding.streams.contains(&stream.id()) {
        binding.streams.push(stream.id());
    }
    Ok(Enlisted::Bound(binding.pool.clone(), binding.misses))
}

/// Notes that `stream` takes part in a capture (it was forked into one), so that blocks of the
/// general cache it frees or uses during the capture are held as graph memory. Returns the
/// capture's pool, if the stream is capturing into a bound capture.
///
/// # Errors
/// The driver's error when the capture status cannot be read.
pub fn note_capture_stream(stream: &Stream) -> Result<Option<GraphPool>> {
    Ok(match enlist(stream)? {
        Enlisted::Bound(pool, _) => Some(pool),
        Enlisted::NotCapturing | Enlisted::Unbound => None,
    })
}

/// The pool and policy of the bound capture `stream` is in; `None` when it is not capturing.
pub(super) fn route(stream: &Stream) -> Result<Option<(u32, MissPolicy)>> {
    let epoch = EPOCH.load(Ordering::Acquire);
    if let Some((seen, id, pool, misses)) = ROUTE.with(std::cell::Cell::get)
        && seen == epoch
        && id == stream.id()
    {
        return Ok(Some((pool, misses)));
    }
    match enlist(stream)? {
        Enlisted::NotCapturing => Ok(None),
        Enlisted::Unbound => Err(MemoryError::Driver(
            GraphError::Capturing {
                operation: "CachingAllocator::allocate",
                reason: "the stream is capturing and no graph pool is bound to its capture",
            }
            .into(),
        )),
        Enlisted::Bound(pool, misses) => {
            let id = pool.token.id;
            ROUTE.with(|cell| cell.set(Some((epoch, stream.id(), id, misses))));
            Ok(Some((id, misses)))
        }
    }
}

/// The pool whose capture has the stream `stream_id` among its streams (the callers pass a
/// general-cache key, which is the stream's id for every stream but the legacy one).
pub(super) fn capturing_pool_of(stream_id: u64) -> Option<GraphPool> {
    BINDINGS
        .read()
        .iter()
        .find(|binding| binding.streams.contains(&stream_id))
        .map(|binding| binding.pool.clone())
}
