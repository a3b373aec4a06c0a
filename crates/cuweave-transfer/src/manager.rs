//! [`TransferManager`]: moves elements between host and devices by the method its plan
//! chooses, keeping statistics.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cuweave_driver::Device;
use cuweave_memory::Element;
use parking_lot::{Mutex, RwLock};
use serde::Serialize;

use crate::advice::{self, RegistrationAdvice, TransferDirection};
use crate::calibration::{CalibrationTable, MachineMismatch};
use crate::device_state::{DeviceSlot, DeviceState, Lane};
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
    /// The report of a transfer of nothing under `plan`: it returned at once.
    pub(crate) fn empty(plan: Plan) -> Self {
        Self {
            plan,
            bytes: 0,
            elapsed: Duration::ZERO,
        }
    }

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

/// Moves elements between pageable host memory, pinned host memory, host memory registered in
/// place ([`register_host`](Self::register_host)), device memory on any device and unified
/// memory, choosing a [`TransferMethod`] per path and size from measured
/// bandwidth ([`calibrate`](Self::calibrate)) or the H100 defaults.
///
/// Devices are opened lazily: constructing a manager makes no context; a device's primary
/// context, pinned pool and streams are made by the first transfer that touches it, so a
/// process that uses one GPU holds nothing on the others. [`for_devices`](Self::for_devices)
/// limits a manager to some devices.
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
    /// One slot per device ordinal the driver sees; `None` for those this manager does not serve.
    pub(crate) slots: Vec<Option<DeviceSlot>>,
    /// A configuration fixed for every size, or `None`: per size from the calibration.
    staging: Option<StagingConfig>,
    measured: RwLock<Measured>,
    defaults: CalibrationTable,
    /// Shared with owned transfers' workers, which count a transfer when it finishes.
    stats: Arc<TransferStats>,
    /// `(from, to)` pairs whose peer access this manager has enabled.
    peers_enabled: Mutex<HashSet<(usize, usize)>>,
}

/// The calibration in use and whether it describes this machine.
#[derive(Debug, Clone, Default)]
struct Measured {
    table: CalibrationTable,
    /// Set when the table's devices differ from this machine's: its figures are then labelled
    /// with the machine they came from.
    foreign: Option<String>,
}

impl std::fmt::Debug for TransferManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferManager")
            .field("devices", &self.devices())
            .field("staging", &self.staging)
            .field("calibrated", &!self.measured.read().table.is_empty())
            .finish_non_exhaustive()
    }
}

impl TransferManager {
    /// A manager for every device, choosing the staging configuration per size from the
    /// calibration; uses this process's calibration if [`calibrate`](Self::calibrate) already
    /// ran, else the H100 defaults. Makes no context: each device is opened on first use.
    ///
    /// # Errors
    /// The driver's error when it is missing.
    pub fn new() -> Result<Self> {
        Self::build(None, None)
    }

    /// A manager for the devices with these ordinals only (the others are never touched, and
    /// transfers involving them are `NoSuchDevice`). Makes no context.
    ///
    /// # Errors
    /// `NoSuchDevice` for an ordinal the driver does not see; the driver's error when it is
    /// missing.
    pub fn for_devices(ordinals: &[usize]) -> Result<Self> {
        Self::build(Some(ordinals), None)
    }

    /// A manager for every device with one staging configuration for every size (for sweeps
    /// and experiments; [`new`](Self::new) picks one per size from the calibration).
    ///
    /// # Errors
    /// [`TransferError::InvalidStaging`] when `staging` cannot run
    /// ([`StagingConfig::validate`]); as [`new`](Self::new) otherwise.
    pub fn with_staging(staging: StagingConfig) -> Result<Self> {
        staging.validate()?;
        Self::build(None, Some(staging))
    }

    fn build(only: Option<&[usize]>, staging: Option<StagingConfig>) -> Result<Self> {
        let served = served(only, Device::count()?)?;
        let slots = served
            .iter()
            .enumerate()
            .map(|(ordinal, &serve)| {
                Ok(serve
                    .then(|| Device::get(ordinal))
                    .transpose()?
                    .map(DeviceSlot::new))
            })
            .collect::<Result<Vec<_>>>()?;
        let manager = Self {
            slots,
            staging,
            measured: RwLock::new(Measured::default()),
            defaults: CalibrationTable::h100_defaults(),
            stats: Arc::default(),
            peers_enabled: Mutex::new(HashSet::new()),
        };
        if let Some(table) = crate::calibrate::process_calibration() {
            manager.set_measured(table);
        }
        Ok(manager)
    }

    /// The number of devices the manager serves.
    pub fn device_count(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// The ordinals of the devices the manager serves.
    pub fn devices(&self) -> Vec<usize> {
        self.slots
            .iter()
            .flatten()
            .map(|slot| slot.device.ordinal())
            .collect()
    }

    /// Whether the manager has opened `device` (retained its context and made its streams):
    /// only a transfer, registration or calibration touching it does.
    pub fn is_open(&self, device: usize) -> bool {
        self.slot(device).is_ok_and(DeviceSlot::is_open)
    }

    /// How many idle lanes (sets of streams, one per staging participant) `device` keeps for
    /// the next transfers: each concurrent transfer holds one lane alone; at most
    /// [`MAX_IDLE_LANES`](crate::MAX_IDLE_LANES) are kept once the burst is over. 0 for a device
    /// not opened.
    pub fn idle_lanes(&self, device: usize) -> usize {
        self.slot(device)
            .ok()
            .filter(|slot| slot.is_open())
            .and_then(|slot| slot.state().ok())
            .map_or(0, |state| state.idle_lanes())
    }

    /// How many of `device`'s progress-mark words no lane holds (each lane's first
    /// [`MARKED_STREAMS`](crate::MARKED_STREAMS) streams hold one each, for ordered copies; a
    /// lane dropped past the idle bound gives its words back).
    /// 0 for a device not opened, or one that cannot map host memory.
    pub fn free_mark_words(&self, device: usize) -> usize {
        self.slot(device)
            .ok()
            .filter(|slot| slot.is_open())
            .and_then(|slot| slot.state().ok())
            .map_or(0, |state| state.free_mark_words())
    }

    /// The staging configuration fixed by [`with_staging`](Self::with_staging), if any.
    pub fn fixed_staging(&self) -> Option<StagingConfig> {
        self.staging
    }

    /// The staging configuration a pipelined transfer of `bytes` on `path` to or from `device`
    /// uses: the fixed one, else the one calibration chose nearest that size, else
    /// [`StagingConfig::for_path`].
    pub fn staging_for(&self, path: TransferPath, device: usize, bytes: usize) -> StagingConfig {
        if let Some(fixed) = self.staging {
            return fixed;
        }
        self.measured
            .read()
            .table
            .staging_for(path, device, bytes)
            .unwrap_or_else(|| StagingConfig::for_path(path, bytes))
    }

    /// The statistics kept so far.
    pub fn stats(&self) -> &TransferStats {
        &self.stats
    }

    /// The statistics, shared with a worker that outlives the call that started it.
    pub(crate) fn shared_stats(&self) -> Arc<TransferStats> {
        Arc::clone(&self.stats)
    }

    /// The measured calibration in use (empty when the defaults decide).
    pub fn calibration(&self) -> CalibrationTable {
        self.measured.read().table.clone()
    }

    /// Uses `table` (e.g. loaded with [`CalibrationTable::load`]) for the method choice.
    ///
    /// When the table was measured on other devices than this machine's, its figures still
    /// decide but every [`Plan`] says where they came from, a `tracing` warning is logged, and
    /// the mismatch is returned: [`recalibrate`](Self::recalibrate) measures this machine.
    pub fn set_calibration(&self, table: CalibrationTable) -> Option<MachineMismatch> {
        let mismatch = table.check_machine(&self.machine());
        if let Some(mismatch) = &mismatch {
            tracing::warn!(%mismatch, "calibration from another machine");
        }
        *self.measured.write() = Measured {
            foreign: mismatch.as_ref().map(|m| m.measured_on()),
            table,
        };
        mismatch
    }

    /// This machine's device names, by ordinal (every device the driver sees; reading a name
    /// makes no context).
    pub fn machine(&self) -> Vec<String> {
        (0..self.slots.len())
            .map(|d| {
                Device::get(d)
                    .and_then(|device| device.name())
                    .unwrap_or_else(|_| "unknown device".to_owned())
            })
            .collect()
    }

    /// Releases cached resources: the staging pools' idle pinned blocks go back to the driver,
    /// and the measured calibration is forgotten (the defaults decide until the next
    /// [`calibrate`](Self::calibrate) or [`set_calibration`](Self::set_calibration)).
    /// Returns the pinned bytes released.
    pub fn clear_cache(&self) -> usize {
        *self.measured.write() = Measured::default();
        self.slots
            .iter()
            .flatten()
            .filter_map(|slot| slot.is_open().then(|| slot.state().ok()).flatten())
            .map(|state| state.pool.trim())
            .sum()
    }

    /// What the devices on the path from `src` to `dst` can do (read from device attributes;
    /// no context is made).
    pub fn facts(&self, src: Location, dst: Location) -> PathFacts {
        let caps = |d: usize| self.slot(d).ok().and_then(|s| s.info().capabilities);
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
                .slot(d)
                .ok()
                .and_then(|slot| slot.info().can_access_peer.get(s).copied())
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
        let facts = self.facts(src, dst);
        let measured = self.measured.read();
        planner::choose_for(
            planner::Query::new(src, dst, bytes),
            &facts,
            &measured.table,
            measured.foreign.as_deref(),
            &self.defaults,
        )
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
        let slot = self.slot(device)?;
        // Refused before the device is opened: a mistake must not leave a context behind.
        crate::registered::refuse_empty(memory)?;
        RegisteredHost::new(&slot.state()?.context, device, memory)
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
            &self.measured.read().table,
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
        let (src, dst) = self.checked(src.into(), dst.into())?;
        let plan = self.plan(src.location(), dst.location(), src.bytes());
        self.run(plan, src, dst, &self.stats)
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
        let (src, dst) = self.checked(src.into(), dst.into())?;
        let (from, to) = (src.location(), dst.location());
        let path = TransferPath::between(from, to);
        let plan = planner::require(path, src.bytes(), &self.facts(from, to), method).map_err(
            |reason| TransferError::Unsupported {
                method,
                path: format!("{from} -> {to}"),
                reason,
            },
        )?;
        self.run(plan, src, dst, &self.stats)
    }

    /// `src` and `dst` once their ranges fit and their devices are served: before any plan, so
    /// that every method gives the same errors (a forced method on an unserved device is
    /// `NoSuchDevice`, not `Unsupported`).
    fn checked<'s, 'd, T: Element>(
        &self,
        src: Source<'s, T>,
        dst: Destination<'d, T>,
    ) -> Result<(Source<'s, T>, Destination<'d, T>)> {
        src.check()?;
        dst.check(src.len())?;
        self.serves(src.location())?;
        self.serves(dst.location())?;
        Ok((src, dst))
    }

    /// Runs `plan`, counting the transfer in `stats` (the manager's, or calibration's own).
    pub(crate) fn run<T: Element>(
        &self,
        plan: Plan,
        src: Source<'_, T>,
        dst: Destination<'_, T>,
        stats: &TransferStats,
    ) -> Result<TransferReport> {
        let bytes = src.bytes();
        if bytes == 0 {
            return Ok(TransferReport::empty(plan));
        }
        let start = Instant::now();
        match crate::execute::execute(self, plan.method, src, dst) {
            Ok(()) => {
                let elapsed = start.elapsed();
                stats.record_success(plan.path, bytes, elapsed);
                Ok(TransferReport {
                    plan,
                    bytes,
                    elapsed,
                })
            }
            Err(error) => {
                stats.record_failure(plan.path, bytes);
                Err(error)
            }
        }
    }

    /// The slot of ordinal `device`, if this manager serves it.
    pub(crate) fn slot(&self, device: usize) -> Result<&DeviceSlot> {
        self.slots
            .get(device)
            .and_then(Option::as_ref)
            .ok_or_else(|| TransferError::NoSuchDevice {
                device,
                count: self.device_count(),
            })
    }

    /// `NoSuchDevice` when `location` is memory on a device this manager does not serve
    /// (device or unified memory; host memory, pinned or not, belongs to no device here),
    /// whatever method would move it: [`for_devices`](Self::for_devices) holds on every path.
    fn serves(&self, location: Location) -> Result<()> {
        match location {
            Location::Device(d) | Location::Unified(d) => self.slot(d).map(drop),
            _ => Ok(()),
        }
    }

    /// The state of ordinal `device`, opened on first use.
    pub(crate) fn device(&self, device: usize) -> Result<&Arc<DeviceState>> {
        self.slot(device)?.state()
    }

    /// A lane of streams on `device` for one transfer.
    pub(crate) fn lane(&self, device: usize) -> Result<Lane> {
        self.device(device)?.lane()
    }

    /// Enables peer access between `a` and `b`, in each direction the hardware allows, once
    /// per manager (enabling costs milliseconds; an already-enabled pair is fine).
    pub(crate) fn enable_peers(&self, a: usize, b: usize) -> Result<()> {
        for (from, to) in [(a, b), (b, a)] {
            let can = self.slot(from)?.info().can_access_peer.get(to).copied();
            if !can.unwrap_or(false) || self.peers_enabled.lock().contains(&(from, to)) {
                continue;
            }
            self.device(from)?
                .context
                .enable_peer_access(&self.device(to)?.context)?;
            self.peers_enabled.lock().insert((from, to));
        }
        Ok(())
    }

    pub(crate) fn set_measured(&self, table: CalibrationTable) {
        self.set_calibration(table);
    }
}

/// Which of `count` device ordinals a manager limited to `only` (all when `None`) serves.
fn served(only: Option<&[usize]>, count: usize) -> Result<Vec<bool>> {
    if let Some(&device) = only.and_then(|o| o.iter().find(|&&d| d >= count)) {
        return Err(TransferError::NoSuchDevice { device, count });
    }
    Ok((0..count)
        .map(|ordinal| only.is_none_or(|o| o.contains(&ordinal)))
        .collect())
}

/// Runs a pipelined transfer on a lane of `state` with `config`.
pub(crate) fn pipeline(lane: &mut Lane, config: StagingConfig, bytes: usize) -> Pipeline<'_> {
    lane.grow(config.workers(bytes.div_ceil(config.chunk_bytes.max(1))));
    Pipeline {
        pool: &lane.state.pool,
        streams: &lane.streams,
        completion: lane.state.completion.as_ref(),
        marks: &lane.marks,
        config,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manager_serves_the_devices_it_was_limited_to() {
        // Two GPUs, as on the two-H200 machine.
        assert_eq!(served(None, 2).unwrap(), vec![true, true]);
        assert_eq!(served(Some(&[1]), 2).unwrap(), vec![false, true]);
        assert_eq!(served(Some(&[0, 1, 1]), 2).unwrap(), vec![true, true]);
        assert_eq!(served(Some(&[]), 2).unwrap(), vec![false, false]);
        assert!(matches!(
            served(Some(&[0, 2]), 2),
            Err(TransferError::NoSuchDevice {
                device: 2,
                count: 2
            })
        ));
        assert_eq!(served(None, 0).unwrap(), Vec::<bool>::new());
    }
}
