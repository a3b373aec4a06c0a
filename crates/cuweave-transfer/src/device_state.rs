//! What the manager keeps per device, made on first use: facts about the device (no context
//! needed to read them) and, once a transfer touches it, its context, pinned pool, completion
//! words and lanes of streams.

use std::sync::{Arc, OnceLock};

use cuweave_driver::memory::CompletionWords;
use cuweave_driver::{Context, Device, DeviceCapabilities, Stream, StreamFlags};
use cuweave_memory::PinnedPool;
use parking_lot::Mutex;

use crate::error::Result;
use crate::workers;

/// Idle lanes a device keeps for reuse; a lane handed back while this many wait is dropped
/// (its streams destroyed), so concurrency bursts leave no unbounded set of streams behind.
pub const MAX_IDLE_LANES: usize = 8;

/// Facts about one device that need no context: read with attribute queries on first use.
#[derive(Debug, Clone)]
pub(crate) struct DeviceInfo {
    /// `None` when the attributes could not be read: then nothing optional is assumed.
    pub(crate) capabilities: Option<DeviceCapabilities>,
    /// `can_access_peer[j]`: this device can access device `j`'s memory.
    pub(crate) can_access_peer: Vec<bool>,
}

/// One device the manager serves: its facts and its state, each made on first use.
pub(crate) struct DeviceSlot {
    pub(crate) device: Device,
    info: OnceLock<DeviceInfo>,
    state: OnceLock<Arc<DeviceState>>,
}

impl DeviceSlot {
    pub(crate) fn new(device: Device) -> Self {
        Self {
            device,
            info: OnceLock::new(),
            state: OnceLock::new(),
        }
    }

    /// The device's facts, read on first call (no context is made). A device whose attributes
    /// cannot be read is treated as able to do nothing optional.
    pub(crate) fn info(&self) -> &DeviceInfo {
        self.info.get_or_init(|| {
            let capabilities = self
                .device
                .capabilities()
                .inspect_err(|error| {
                    tracing::warn!(%error, device = self.device.ordinal(), "device capabilities unreadable");
                })
                .ok();
            let can_access_peer = Device::all()
                .unwrap_or_default()
                .iter()
                .map(|peer| self.device.can_access_peer(peer).unwrap_or(false))
                .collect();
            DeviceInfo {
                capabilities,
                can_access_peer,
            }
        })
    }

    /// Whether this manager has made the device's state (retained its context).
    pub(crate) fn is_open(&self) -> bool {
        self.state.get().is_some()
    }

    /// The device's state, made on first call: its primary context retained, a pinned pool,
    /// completion words. Two threads racing here may both build one; the loser's is dropped.
    pub(crate) fn state(&self) -> Result<&Arc<DeviceState>> {
        if let Some(state) = self.state.get() {
            return Ok(state);
        }
        let built = Arc::new(DeviceState::open(self.device)?);
        tracing::debug!(device = self.device.ordinal(), "transfer state made");
        Ok(self.state.get_or_init(|| built))
    }
}

/// A device's transfer state: context, staging pool, completion words and idle lanes.
pub(crate) struct DeviceState {
    pub(crate) context: Arc<Context>,
    pub(crate) pool: PinnedPool,
    /// Words for learning that a small upload landed without a driver call (`None` when the
    /// device cannot map host memory).
    pub(crate) completion: Option<CompletionWords>,
    lanes: Mutex<Vec<Vec<Stream>>>,
}

impl DeviceState {
    fn open(device: Device) -> Result<Self> {
        let context = Context::primary(device)?;
        // Without mapped host memory the small uploads synchronise their stream instead.
        let completion = CompletionWords::new(&context)
            .inspect_err(|error| {
                tracing::debug!(%error, "no completion words: small uploads use cuStreamSynchronize");
            })
            .ok();
        Ok(Self {
            pool: PinnedPool::new(&context),
            context,
            completion,
            lanes: Mutex::new(Vec::new()),
        })
    }

    /// A lane this caller holds alone until it drops it: one stream per staging participant.
    /// An idle lane is reused; otherwise one is made (the first transfer of each concurrent
    /// caller pays for its streams once).
    pub(crate) fn lane(self: &Arc<Self>) -> Result<Lane> {
        let idle = self.lanes.lock().pop();
        let streams = match idle {
            Some(streams) => streams,
            None => (0..workers::shared().participants())
                .map(|_| Stream::new(&self.context, StreamFlags::NON_BLOCKING))
                .collect::<cuweave_driver::Result<Vec<_>>>()?,
        };
        Ok(Lane {
            streams,
            state: Arc::clone(self),
        })
    }

    /// Idle lanes kept for reuse (at most [`MAX_IDLE_LANES`]).
    pub(crate) fn idle_lanes(&self) -> usize {
        self.lanes.lock().len()
    }
}

/// Streams one transfer holds alone; back to the device's idle lanes on drop.
pub(crate) struct Lane {
    pub(crate) streams: Vec<Stream>,
    pub(crate) state: Arc<DeviceState>,
}

impl Lane {
    /// The lane's first stream (single-stream work: peer copies, prefetches, small copies).
    pub(crate) fn stream(&self) -> &Stream {
        &self.streams[0]
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let mut idle = self.state.lanes.lock();
        if idle.len() < MAX_IDLE_LANES {
            idle.push(std::mem::take(&mut self.streams));
        }
    }
}
