//! Capture-safe memory: private pools bound to stream captures (PyTorch's graph pools).
//!
//! While a stream captures, the work queued on it is recorded into a graph that will replay
//! later, again and again, at the addresses it was captured with. Memory the capture uses must
//! therefore belong to the graph for as long as the graph exists, and the allocator must not
//! make the calls that break a capture (`cuMemAlloc`, `cuMemFree`, event queries, waits).
//!
//! - A capture is bound to a [`GraphPool`] with [`begin_allocate_to_pool`] (the stream layer
//!   does this for every capture). Allocations made on a stream of that capture (its origin and
//!   every stream forked into it) come from the pool's own free lists, keyed by (pool, stream):
//!   a block is reused only by later work of the same capture on the same stream, or by a later
//!   capture into the same pool, never by eager work.
//! - A miss first adopts a whole free segment of a dead pool known idle (see
//!   `engine_capture.rs`: seen dead and free before the capture's begin synchronisation), else
//!   takes a new segment from the upstream with the thread in relaxed capture mode (the
//!   allocation is not part of the graph and is safe to make), or, with
//!   [`MissPolicy::Fail`], fails with [`GraphError::Capturing`]. No out-of-memory retry runs
//!   during a capture (it would wait for the device).
//! - Nothing polls events while any capture is active, and no capture begins while they are
//!   polled (`outside_captures`: a poll would break another thread's global-mode capture):
//!   pending blocks wait.
//! - A free during a capture that would record or poll events is deferred until no capture is
//!   active: a raw block used on other streams (`record_stream`), or a typed buffer's block with
//!   any tracked use, on its own stream too (the next buffer made from the block may be used on
//!   any stream, so its own stream's order does not cover the old uses). A block of the general
//!   cache freed during the capture
//!   of its stream (or used there) is graph memory from then on: it is held by the pool and
//!   returns to the general cache, after the device has finished, when the pool is dropped. A
//!   typed buffer remembers the pool of each capture that used it (looked up when the use is
//!   recorded; a capture not bound yet is looked up again at the next record and at the free;
//!   a capture is never rebound to another pool, since its graph keeps only the first: so
//!   however many captures come and go before the free, and however many use the buffer, the
//!   pool is known): at the free, the pools still alive hold it, and it returns when
//!   the last of them dies. Used by a capture no pool was bound to, it is stranded for good
//!   ([`stranded_graph_memory`]), never handed out again.
//! - A typed buffer of another memory resource freed during a capture is held like a block
//!   when a capture used it; else it is deallocated once no capture is active as an eager drop
//!   deallocates it (on its home stream behind its uses' events).
//! - Deferred frees that wait for nothing on the host once no capture is active (a typed block
//!   or resource allocation no capture used, behind its eager events; a raw block's
//!   `record_stream` uses) are carried out by the first allocation made once none is active;
//!   those that wait for the device, by [`CachingAllocator::empty_cache`], a pool binding's end,
//!   a pool's death, or the next capture-time free with no capture active.
//! - A pool lives as long as its last holder: the [`GraphPool`] handles and every graph and
//!   executable it is attached to ([`GraphPool::keep_alive`]). Until then
//!   [`CachingAllocator::empty_cache`] leaves its segments alone; after, they are released like
//!   any other free segment. The allocator may be dropped first: its last handle hands the
//!   segments of live pools to those pools, with its upstream, to be returned when they die.
//!
//! With no capture active anywhere, allocation and free pay one atomic load for all this.
//!
//! [`GraphError::Capturing`]: cuweave_driver::graph::GraphError::Capturing
//! [`CachingAllocator::empty_cache`]: crate::caching::CachingAllocator::empty_cache

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use cuweave_driver::Stream;
use cuweave_driver::graph::KeepAlive;
use parking_lot::{Mutex, RwLock};

use super::stream_uses::StreamKey;

#[path = "graph_pool_binding.rs"]
mod binding;
#[path = "graph_pool_during_capture.rs"]
mod during_capture;
#[path = "graph_pool_held.rs"]
mod held;
#[path = "graph_pool_retire.rs"]
mod retire;

pub(crate) use binding::pool_tag_of_capture;
pub use binding::{AllocateToPool, MissPolicy, begin_allocate_to_pool, note_capture_stream};
pub(super) use during_capture::{refuse_during_capture, release_during_capture};
pub(crate) use during_capture::{release_block_during_capture, release_resource_during_capture};
pub(in crate::caching) use held::flush_deferred as flush_frees_deferred_by_captures;
pub use held::stranded_graph_memory;
pub(crate) use held::{
    GraphHeld, defer_until_no_capture, hold_for_graphs, return_frees_deferred_by_captures,
    synchronize_once,
};
use held::{Held, HeldMemory, defer, flush_deferred};
pub(crate) use retire::{SegmentHome, retire_engine};

/// The high bit of a [`StreamKey`] marks a private pool's free list.
const PRIVATE_BIT: usize = 1 << (usize::BITS - 1);

/// The identity of a private pool (PyTorch's `MempoolId_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GraphPoolId(u32);

impl GraphPoolId {
    /// The id as an integer.
    pub fn as_u32(self) -> u32 {
        self.0
    }
}

impl fmt::Display for GraphPoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "graph pool {}", self.0)
    }
}

static NEXT_POOL: AtomicU32 = AtomicU32::new(1);
/// Pools with a holder left, by id: their segments are never released, and memory a buffer used
/// in their captures is held by them (a buffer names them by [tag](pool_tag_of_capture)).
static LIVE: RwLock<Option<HashMap<u32, Weak<PoolToken>>>> = RwLock::new(None);

/// The tag a buffer remembers for a capture with no graph pool bound to it: memory it used is
/// stranded ([`stranded_graph_memory`]). Pool tags are pool ids, below 2^31.
pub(crate) const NO_POOL: u64 = u64::MAX;

/// What keeps a pool alive; dropping the last one retires the pool.
struct PoolToken {
    id: u32,
    /// Memory freed while it was graph memory of this pool's captures: held until it dies.
    held: Mutex<Vec<Held>>,
}

impl Drop for PoolToken {
    fn drop(&mut self) {
        if let Some(live) = LIVE.write().as_mut() {
            live.remove(&self.id);
        }
        let held = std::mem::take(&mut *self.held.lock());
        if held.is_empty() {
            return;
        }
        let mut free = Vec::new();
        for mut item in held {
            let next = loop {
                match item.also.pop() {
                    None => break None,
                    Some(weak) => {
                        if let Some(token) = weak.upgrade() {
                            break Some(token);
                        }
                    }
                }
            };
            match next {
                Some(token) => token.held.lock().push(item),
                None => free.push(item),
            }
        }
        if !free.is_empty() {
            free.into_iter().for_each(defer);
            flush_deferred();
        }
    }
}

/// A private memory pool for graph captures (`graph_pool_handle()` in PyTorch). Cheap to clone;
/// captures given clones of one pool share its memory (their graphs must then not replay
/// concurrently, as in PyTorch).
#[derive(Clone)]
pub struct GraphPool {
    token: Arc<PoolToken>,
}

impl fmt::Debug for GraphPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GraphPool")
            .field("id", &self.token.id)
            .field("holders", &Arc::strong_count(&self.token))
            .finish()
    }
}

impl Default for GraphPool {
    fn default() -> Self {
        Self::new()
    }
}

/// A new private pool (PyTorch's `torch.cuda.graph_pool_handle()`).
pub fn graph_pool_handle() -> GraphPool {
    GraphPool::new()
}

impl GraphPool {
    /// A new, empty private pool.
    pub fn new() -> Self {
        let mut live = LIVE.write();
        let live = live.get_or_insert_with(HashMap::new);
        let id = free_pool_id(&NEXT_POOL, live);
        let token = Arc::new(PoolToken {
            id,
            held: Mutex::new(Vec::new()),
        });
        live.insert(id, Arc::downgrade(&token));
        Self { token }
    }

    /// The pool's id.
    pub fn id(&self) -> GraphPoolId {
        GraphPoolId(self.token.id)
    }

    /// A handle that keeps the pool alive, for a graph or executable to hold
    /// ([`Graph::keep_alive`](cuweave_driver::Graph::keep_alive)).
    pub fn keep_alive(&self) -> KeepAlive {
        Arc::clone(&self.token) as Arc<dyn Any + Send + Sync>
    }

    /// [`keep_alive`](Self::keep_alive) for
    /// [`Graph::keep_alive_synchronizing`](cuweave_driver::Graph::keep_alive_synchronizing):
    /// memory the pool holds goes back only after its context synchronised, so launches of a
    /// graph holding it need no fence for it.
    pub fn synchronizing_keep_alive(&self) -> cuweave_driver::graph::SynchronizingKeepAlive {
        #[allow(unsafe_code)]
        // SAFETY: when the last token dies, nothing of the pool is reused before the device has
        // finished with it: `PoolToken::drop` hands the general cache's blocks and resources
        // it held to the deferred frees, and `return_block` synchronises their context first (deferred
        // while a capture forbids the wait); the pool's own segments are adopted only by a
        // capture whose context synchronised after the pool was seen dead and idle
        // (`engine_capture`), and go back to the driver only through `cuMemFree`, which waits.
        unsafe {
            cuweave_driver::graph::SynchronizingKeepAlive::new(self.keep_alive())
        }
    }

    /// How many handles, graphs and executables keep the pool alive.
    pub fn holders(&self) -> usize {
        Arc::strong_count(&self.token)
    }
}

/// The next pool id (31 bits, as a free-list key holds it; never 0) that no live pool has:
/// the counter wraps after 2^31 pools, and a live pool's id handed out again would let the new
/// pool's death pass for the old one's (its held memory returned under a live graph).
fn free_pool_id(next: &AtomicU32, live: &HashMap<u32, Weak<PoolToken>>) -> u32 {
    loop {
        let id = next.fetch_add(1, Ordering::Relaxed) & 0x7fff_ffff;
        if id != 0 && !live.contains_key(&id) {
            return id;
        }
    }
}

/// The private pool whose free lists `key` names, if it is a private key.
pub(crate) fn graph_pool_of_key(key: StreamKey) -> Option<GraphPoolId> {
    let raw = key.as_usize();
    (raw & PRIVATE_BIT != 0).then_some(GraphPoolId(((raw & !PRIVATE_BIT) >> 32) as u32))
}

/// Whether `key` names a private pool that still has a holder (its segments stay reserved).
pub(crate) fn is_retained(key: StreamKey) -> bool {
    let Some(pool) = graph_pool_of_key(key) else {
        return false;
    };
    LIVE.read()
        .as_ref()
        .is_some_and(|live| live.contains_key(&pool.as_u32()))
}

/// The pool of `tag`, if it is still alive.
fn pool_of_tag(tag: u64) -> Option<Arc<PoolToken>> {
    let id = u32::try_from(tag).ok()?;
    LIVE.read().as_ref()?.get(&id)?.upgrade()
}

/// Whether the pool of `tag` still has a holder.
pub(crate) fn pool_tag_is_live(tag: u64) -> bool {
    pool_of_tag(tag).is_some()
}

fn private_key(pool: u32, stream: &Stream) -> StreamKey {
    StreamKey::from_raw(
        PRIVATE_BIT | ((pool as usize & 0x7fff_ffff) << 32) | (stream.id() as usize & 0xffff_ffff),
    )
}

/// Binding captures and holding memory without a GPU, for the tests of the buffers' use
/// tracking, which names pools by the tags [`pool_tag_of_capture`] gives.
#[cfg(test)]
pub(crate) mod test_support {
    use super::binding::bind_capture;
    use super::held::hold_for_captures;
    use super::*;
    use crate::error::Result;

    thread_local! {
        /// A capture faked on this thread: held memory it returns waits, as for a real one.
        pub(crate) static FAKE_CAPTURE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Binds `capture` to `pool` as [`begin_allocate_to_pool`] does, until the guard drops.
    pub(crate) fn bind(capture: u64, pool: &GraphPool) -> AllocateToPool {
        try_bind(capture, pool).expect("the capture is bound to no other pool")
    }

    /// [`bind`], refused as [`begin_allocate_to_pool`] refuses a capture bound to another pool.
    pub(crate) fn try_bind(capture: u64, pool: &GraphPool) -> Result<AllocateToPool> {
        bind_capture(capture, pool, MissPolicy::AllocateRelaxed, Vec::new())?;
        Ok(AllocateToPool {
            capture,
            pool: pool.clone(),
        })
    }

    /// Frees `bytes` of memory that the captures of the pools `tags` used, as a buffer's free
    /// does; the count goes up when the memory is returned.
    pub(crate) fn hold(tags: &[u64], bytes: usize) -> Arc<std::sync::atomic::AtomicUsize> {
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let held = Held {
            memory: HeldMemory::Probe(Arc::clone(&count)),
            also: Vec::new(),
        };
        hold_for_captures(held, tags, bytes);
        flush_deferred();
        count
    }

    /// Flushes deferred frees until `done` holds or a generous deadline passes; whether it
    /// holds. A flush that finds the list empty returns at once, while another test's flush
    /// that took the list may still be returning it: a test that expects memory back after a
    /// flush polls for it.
    pub(crate) fn flushed_until(mut done: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            flush_deferred();
            if done() {
                return true;
            }
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// The count of a probe once it reaches `expected` (or the deadline of [`flushed_until`]
    /// passes first), flushing meanwhile.
    pub(crate) fn returned_eventually(
        count: &std::sync::atomic::AtomicUsize,
        expected: usize,
    ) -> usize {
        flushed_until(|| count.load(Ordering::SeqCst) >= expected);
        count.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
#[path = "graph_pool_tests.rs"]
mod tests;
