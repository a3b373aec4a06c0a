//! [`TransferManager`]: moves elements between host and devices by the method its plan
//! chooses, keeping statistics.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::memory::CompletionWords;
use cuweave_driver::{Context, Device, DeviceCapabilities, Stream, StreamFlags};
use cuweave_memory::{Element, PinnedPool};
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use crate::advice::{self, RegistrationAdvice, TransferDirection};
use crate::calibration::CalibrationTable;
use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::location::{Location, LocationKind, TransferPath};
use crate::method::TransferMethod;
use crate::planner::{self, PathFacts, Plan};
use crate::registered::RegisteredHost;
use crate::staging::{Pipeline, StagingConfig};
use crate::stats::TransferStats;

/// What one transfer did: the plan it ran, the bytes it moved and how long it took.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TransferReport {
    /// The plan that ran.
    pub plan: Plan,
    /// Bytes moved.
    pub bytes: usize,
    /// Wall time, from the call to the data being in place.
    pub elapsed: Duration,
}

impl TransferReport {
    /// Bandwidth of this transfer, GB/s (10^9 bytes per second); 0 for an empty transfer.
    pub fn gbps(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if self.bytes == 0 || secs == 0.0 {
            0.0
        } else {
            self.bytes as f64 / secs / 1e9
        }
    }
}

/// What the manager keeps per device: its context, capabilities, staging pool and the streams
/// its pipeline workers queue copies on.
pub(crate) struct DeviceState {
    pub(crate) context: Arc<Context>,
    pub(crate) capabilities: DeviceCapabilities,
    pub(crate) pool: PinnedPool,
    pub(crate) streams: Vec<Stream>,
    /// Words for learning that a small upload landed without a driver call (`None` when the
    /// device cannot map host memory).
    pub(crate) completion: Option<CompletionWords>,
    /// `can_access_peer[j]`: this device can access device `j`'s memory.
    pub(crate) can_access_peer: Vec<bool>,
}

/// Moves elements between pageable host memory, pinned host memory, host memory registered in
/// place ([`register_host`](Self::register_host)), device memory on any device and unified
/// memory, choosing a [`TransferMethod`] per path and size from measured
/// bandwidth ([`calibrate`](Self::calibrate)) or the H100 defaults.
///
/// Every transfer is blocking: it returns once the data is in place. [`plan`](Self::plan)
/// says which method a transfer would use and why; [`transfer_with`](Self::transfer_with)
/// forces one (a typed error when the path or the devices cannot do it). Statistics per path
/// and size class are in [`stats`](Self::stats).
///
/// ```no_run
/// use cuweave_driver::{Context, Device};
/// use cuweave_memory::DeviceBuffer;
/// use cuweave_transfer::{Destination, Source, TransferManager};
///
/// # fn main() -> Result<(), cuweave_transfer::TransferError> {
/// let manager = TransferManager::new()?;
/// let context = Context::primary(Device::get(0)?)?;
/// let host = vec![7u8; 256 << 20];
/// let mut device = DeviceBuffer::<u8>::new(&context, host.len())?;
/// let report = manager.transfer(&host, &mut device)?; // pipelined through pinned blocks
/// println!("{} at {:.1} GB/s", report.plan, report.gbps());
/// let mut back = vec![0u8; 1000];
/// manager.transfer(Source::device(&device, 5, 1000), Destination::Host(&mut back))?;
/// assert!(back.iter().all(|&b| b == 7));
/// # Ok(())
/// # }
/// ```
pub struct TransferManager {
    pub(crate) devices: Vec<DeviceState>,
    staging: StagingConfig,
    measured: RwLock<CalibrationTable>,
    defaults: CalibrationTable,
    stats: TransferStats,
    /// `(from, to)` pairs whose peer access this manager has enabled.
    peers_enabled: Mutex<HashSet<(usize, usize)>>,
}

impl std::fmt::Debug for TransferManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferManager")
            .field("devices", &self.devices.len())
            .field("staging", &self.staging)
            .field("calibrated", &!self.measured.read().is_empty())
            .finish_non_exhaustive()
    }
}

impl TransferManager {
    /// A manager for every device, with the default [`StagingConfig`]; uses this process's
    /// calibration if [`calibrate`](Self::calibrate) already ran, else the H100 defaults.
    ///
    /// # Errors
    /// The driver's error when it is missing or a device cannot be opened.
    pub fn new() -> Result<Self> {
        Self::with_staging(StagingConfig::default())
    }

    /// A manager for every device with the given staging configuration.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_staging(staging: StagingConfig) -> Result<Self> {
        let all = Device::all()?;
        let mut devices = Vec::with_capacity(all.len());
        for device in &all {
            let context = Context::primary(*device)?;
            let streams = (0..staging.threads.max(1))
                .map(|_| Stream::new(&context, StreamFlags::NON_BLOCKING))
                .collect::<cuweave_driver::Result<Vec<_>>>()?;
            let can_access_peer = all
                .iter()
                .map(|peer| device.can_access_peer(peer))
                .collect::<cuweave_driver::Result<Vec<_>>>()?;
            // Without mapped host memory the small uploads synchronise their stream instead.
            let completion = CompletionWords::new(&context)
                .inspect_err(|error| {
                    tracing::debug!(%error, "no completion words: small uploads use cuStreamSynchronize");
                })
                .ok();
            devices.push(DeviceState {
                capabilities: device.capabilities()?,
                completion,
                pool: PinnedPool::new(&context),
                context,
                streams,
                can_access_peer,
            });
        }
        let measured = crate::calibrate::process_calibration().unwrap_or_default();
        Ok(Self {
            devices,
            staging,
            measured: RwLock::new(measured),
            defaults: CalibrationTable::h100_defaults(),
            stats: TransferStats::default(),
            peers_enabled: Mutex::new(HashSet::new()),
        })
    }

    /// The number of devices the manager serves.
    pub fn device_count(&self) -> usize {
        self.devices.len()
    }

    /// The staging configuration of pipelined copies.
    pub fn staging(&self) -> StagingConfig {
        self.staging
    }

    /// The statistics kept so far.
    pub fn stats(&self) -> &TransferStats {
        &self.stats
    }

    /// The measured calibration in use (empty when the defaults decide).
    pub fn calibration(&self) -> CalibrationTable {
        self.measured.read().clone()
    }

    /// Uses `table` (e.g. loaded with [`CalibrationTable::load`]) for the method choice.
    pub fn set_calibration(&self, table: CalibrationTable) {
        *self.measured.write() = table;
    }

    /// Releases cached resources: the staging pools' idle pinned blocks go back to the driver,
    /// and the measured calibration is forgotten (the defaults decide until the next
    /// [`calibrate`](Self::calibrate) or [`set_calibration`](Self::set_calibration)).
    /// Returns the pinned bytes released.
    pub fn clear_cache(&self) -> usize {
        *self.measured.write() = CalibrationTable::default();
        self.devices.iter().map(|d| d.pool.trim()).sum()
    }

    /// What the devices on the path from `src` to `dst` can do.
    pub fn facts(&self, src: Location, dst: Location) -> PathFacts {
        let caps = |d: usize| self.devices.get(d).map(|s| s.capabilities);
        let path = TransferPath::between(src, dst);
        let map_host_memory = !path.cross_device
            && [src, dst]
                .iter()
                .filter_map(|l| l.device())
                .all(|d| caps(d).is_some_and(|c| c.can_map_host_memory && c.unified_addressing));
        let managed_prefetch = [src, dst]
            .iter()
            .filter(|l| l.kind() == LocationKind::Unified)
            .filter_map(|l| l.device())
            .all(|d| caps(d).is_some_and(|c| c.concurrent_managed_access));
        let peer_access = match (src.device(), dst.device()) {
            (Some(s), Some(d)) if s != d => self
                .devices
                .get(d)
                .and_then(|state| state.can_access_peer.get(s).copied())
                .unwrap_or(false),
            _ => false,
        };
        PathFacts {
            map_host_memory,
            managed_prefetch,
            peer_access,
        }
    }

    /// The method a transfer of `bytes` from `src` to `dst` would use, and why.
    pub fn plan(&self, src: Location, dst: Location, bytes: usize) -> Plan {
        let path = TransferPath::between(src, dst);
        let facts = self.facts(src, dst);
        planner::choose(path, bytes, &facts, &self.measured.read(), &self.defaults)
    }

    /// Page-locks the caller's `memory` in place (`cuMemHostRegister`, in device `device`'s
    /// context; portable, so every device's copies DMA it directly) until the returned
    /// [`RegisteredHost`] is dropped or [`unregister`](RegisteredHost::unregister)ed.
    ///
    /// Registering costs milliseconds; it pays for a buffer transferred many times, which
    /// [`registration_advice`](Self::registration_advice) works out from the calibration.
    ///
    /// # Errors
    /// `NoSuchDevice` for an ordinal the manager does not serve, `EmptyRegistration` for a slice
    /// without bytes (both before any driver call); the driver's error otherwise (memory that
    /// is already registered, or that cannot be locked).
    pub fn register_host<'a, T: Element>(
        &self,
        device: usize,
        memory: &'a mut [T],
    ) -> Result<RegisteredHost<'a, T>> {
        let state = self
            .devices
            .get(device)
            .ok_or(TransferError::NoSuchDevice {
                device,
                count: self.devices.len(),
            })?;
        RegisteredHost::new(&state.context, device, memory)
    }

    /// Whether registering a host buffer of `bytes` pays for `expected_transfers` transfers
    /// in `direction`: the one-off cost of registering and unregistering plus the transfers at
    /// registered (pinned) speed, against the same transfers from pageable memory by the best
    /// pageable method, all from this machine's calibration where measured (else the H100
    /// defaults and the registration cost of
    /// [`RegistrationCost::H100_DEFAULT`](crate::RegistrationCost::H100_DEFAULT)).
    ///
    /// ```no_run
    /// use cuweave_transfer::{TransferDirection, TransferManager};
    ///
    /// # fn main() -> Result<(), cuweave_transfer::TransferError> {
    /// let manager = TransferManager::new()?;
    /// manager.calibrate()?;
    /// let advice = manager.registration_advice(TransferDirection::HostToDevice, 64 << 20, 100);
    /// println!("{}", advice.reason);
    /// if advice.pays {
    ///     // manager.register_host(0, &mut buffer)? ...
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub fn registration_advice(
        &self,
        direction: TransferDirection,
        bytes: usize,
        expected_transfers: u64,
    ) -> RegistrationAdvice {
        advice::advise(
            direction,
            bytes,
            expected_transfers,
            &self.measured.read(),
            &self.defaults,
        )
    }

    /// Moves `src`'s elements into `dst` by the planned method; returns once they are there.
    ///
    /// A zero-length transfer checks its offsets and returns without a driver call.
    ///
    /// # Errors
    /// `OutOfRange` / `LengthMismatch` for bad ranges (before any driver call), the memory
    /// layer's or driver's error otherwise.
    pub fn transfer<'s, 'd, T: Element>(
        &self,
        src: impl Into<Source<'s, T>>,
        dst: impl Into<Destination<'d, T>>,
    ) -> Result<TransferReport> {
        let (src, dst) = (src.into(), dst.into());
        src.check()?;
        dst.check(src.len())?;
        let plan = self.plan(src.location(), dst.location(), src.bytes());
        self.run(plan, src, dst)
    }

    /// Moves `src`'s elements into `dst` with `method`.
    ///
    /// # Errors
    /// `Unsupported` when `method` does not serve the path or the devices cannot do it; as
    /// [`transfer`](Self::transfer) otherwise.
    pub fn transfer_with<'s, 'd, T: Element>(
        &self,
        method: TransferMethod,
        src: impl Into<Source<'s, T>>,
        dst: impl Into<Destination<'d, T>>,
    ) -> Result<TransferReport> {
        let (src, dst) = (src.into(), dst.into());
        src.check()?;
        dst.check(src.len())?;
        let (from, to) = (src.location(), dst.location());
        let path = TransferPath::between(from, to);
        let plan = planner::require(path, src.bytes(), &self.facts(from, to), method).map_err(
            |reason| TransferError::Unsupported {
                method,
                path: format!("{from} -> {to}"),
                reason,
            },
        )?;
        self.run(plan, src, dst)
    }

    fn run<T: Element>(
        &self,
        plan: Plan,
        src: Source<'_, T>,
        dst: Destination<'_, T>,
    ) -> Result<TransferReport> {
        let bytes = src.bytes();
        if bytes == 0 {
            return Ok(TransferReport {
                plan,
                bytes,
                elapsed: Duration::ZERO,
            });
        }
        let start = Instant::now();
        match crate::execute::execute(self, plan.method, src, dst) {
            Ok(()) => {
                let elapsed = start.elapsed();
                self.stats.record_success(plan.path, bytes, elapsed);
                Ok(TransferReport {
                    plan,
                    bytes,
                    elapsed,
                })
            }
            Err(error) => {
                self.stats.record_failure(plan.path, bytes);
                Err(error)
            }
        }
    }

    /// The device state for ordinal `device`.
    pub(crate) fn device(&self, device: usize) -> &DeviceState {
        &self.devices[device]
    }

    /// The staging pipeline of `device`.
    pub(crate) fn pipeline(&self, device: usize) -> Pipeline<'_> {
        let state = self.device(device);
        Pipeline {
            pool: &state.pool,
            streams: &state.streams,
            completion: state.completion.as_ref(),
            config: self.staging,
        }
    }

    /// Enables peer access between `a` and `b`, in each direction the hardware allows, once
    /// per manager (enabling costs milliseconds; an already-enabled pair is fine).
    pub(crate) fn enable_peers(&self, a: usize, b: usize) -> Result<()> {
        for (from, to) in [(a, b), (b, a)] {
            if !self.device(from).can_access_peer[to]
                || self.peers_enabled.lock().contains(&(from, to))
            {
                continue;
            }
            self.device(from)
                .context
                .enable_peer_access(&self.device(to).context)?;
            self.peers_enabled.lock().insert((from, to));
        }
        Ok(())
    }

    pub(crate) fn set_measured(&self, table: CalibrationTable) {
        *self.measured.write() = table;
    }
}
