//! What calibration measures per device and device pair: the pageable, pinned and registered
//! host paths at each size, the cost of registering host memory, and the peer path.

use std::time::{Duration, Instant};

use cuweave_memory::{DeviceBuffer, PinnedBuffer};

use super::timing::typical_gbps;
use super::{CALIBRATION_SIZES, peer_measure};
use crate::calibration::{CalibrationTable, RegistrationCost};
use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::location::{Location, TransferPath};
use crate::manager::TransferManager;
use crate::method::TransferMethod;
use crate::planner;
use crate::stats::TransferStats;

/// The two sizes registration is timed at, to fit its fixed part and its part per MiB.
const REGISTRATION_SIZES: [usize; 2] = [4 << 20, 64 << 20];
/// Registrations timed per size; the fastest counts.
const REGISTRATION_RUNS: usize = 2;

impl TransferManager {
    pub(super) fn measure_host_paths(
        &self,
        d: usize,
        with_registration: bool,
        table: &mut CalibrationTable,
        stats: &TransferStats,
    ) -> Result<()> {
        let context = std::sync::Arc::clone(&self.device(d)?.context);
        let largest = *CALIBRATION_SIZES.last().expect("sizes are listed");
        let mut device = DeviceBuffer::<u8>::zeroed(&context, largest)?;
        let mut pinned = PinnedBuffer::<u8>::zeroed(&context, largest)?;
        let mut host = vec![1u8; largest];
        for bytes in CALIBRATION_SIZES {
            for path in [
                TransferPath::PAGEABLE_TO_DEVICE,
                TransferPath::DEVICE_TO_PAGEABLE,
                TransferPath::PINNED_TO_DEVICE,
                TransferPath::DEVICE_TO_PINNED,
            ] {
                let (src, dst) = if path.src == crate::LocationKind::Device {
                    (Location::Device(d), host_location(path.dst, d))
                } else {
                    (host_location(path.src, d), Location::Device(d))
                };
                let at = planner::Query::new(src, dst, bytes).measure;
                if path.src == crate::LocationKind::Pageable
                    || path.dst == crate::LocationKind::Pageable
                {
                    // The pipeline's candidates and the plain call, in the same rounds.
                    let (staged, direct) =
                        self.tune_staging(d, path, bytes, &mut host, &mut device, table, stats)?;
                    table.record_at(at, TransferMethod::HostStaged, staged);
                    table.record_at(at, TransferMethod::DirectCopy, direct);
                    continue;
                }
                for &method in TransferMethod::candidates(path) {
                    let gbps = typical_gbps(bytes, || match path {
                        p if p == TransferPath::PINNED_TO_DEVICE => self.run_with(
                            method,
                            Source::pinned(&pinned, 0, bytes),
                            Destination::Device(&mut device, 0),
                            stats,
                        ),
                        _ => self.run_with(
                            method,
                            Source::device(&device, 0, bytes),
                            Destination::Pinned(&mut pinned, 0),
                            stats,
                        ),
                    });
                    match gbps {
                        Ok(gbps) => table.record_at(at, method, gbps),
                        // A method the devices cannot do is not a candidate; skip it.
                        Err(TransferError::Unsupported { .. }) => {}
                        Err(error) => return Err(error),
                    }
                }
            }
        }
        if with_registration {
            match self.measure_registration_cost(d, &mut host) {
                Ok(cost) => table.registration = Some(cost),
                // The driver refused to register (or unregister) host memory: leave the
                // registration figures out rather than the whole calibration.
                Err(TransferError::Driver(error)) => {
                    tracing::warn!(%error, "host registration not calibrated");
                    return Ok(());
                }
                Err(error) => return Err(error),
            }
        }
        match self.measure_registered_paths(d, &mut host, &mut device, table, stats) {
            Ok(()) | Err(TransferError::Driver(_)) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// The cost of registering host memory, fitted through [`REGISTRATION_SIZES`].
    fn measure_registration_cost(&self, d: usize, host: &mut [u8]) -> Result<RegistrationCost> {
        let [small, large] = REGISTRATION_SIZES;
        let mut time = |bytes: usize| -> Result<Duration> {
            let mut best = Duration::MAX;
            for _ in 0..REGISTRATION_RUNS {
                let start = Instant::now();
                self.register_host(d, &mut host[..bytes])?.unregister()?;
                best = best.min(start.elapsed());
            }
            Ok(best)
        };
        let (small_time, large_time) = (time(small)?, time(large)?);
        let cost = RegistrationCost::fit((small, small_time), (large, large_time));
        tracing::debug!(
            ?cost,
            ?small_time,
            ?large_time,
            "host registration measured"
        );
        Ok(cost)
    }

    /// The registered paths' `DirectCopy` per size on device `d`, with `host` (pageable, every
    /// page touched) page-locked in place.
    fn measure_registered_paths(
        &self,
        d: usize,
        host: &mut [u8],
        device: &mut DeviceBuffer<u8>,
        table: &mut CalibrationTable,
        stats: &TransferStats,
    ) -> Result<()> {
        let method = TransferMethod::DirectCopy;
        let mut registered = self.register_host(d, host)?;
        for bytes in CALIBRATION_SIZES {
            let up = typical_gbps(bytes, || {
                self.run_with(
                    method,
                    Source::registered(&registered, 0, bytes),
                    Destination::Device(&mut *device, 0),
                    stats,
                )
            })?;
            let at = planner::Query::new(Location::RegisteredHost(d), Location::Device(d), bytes);
            table.record_at(at.measure, method, up);
            let down = typical_gbps(bytes, || {
                self.run_with(
                    method,
                    Source::device(device, 0, bytes),
                    Destination::registered(&mut registered, 0),
                    stats,
                )
            })?;
            let at = planner::Query::new(Location::Device(d), Location::RegisteredHost(d), bytes);
            table.record_at(at.measure, method, down);
        }
        registered.unregister()?;
        Ok(())
    }

    /// The peer path's candidates from device `from` to device `to`, per size, recorded for
    /// that ordered pair.
    pub(super) fn measure_peer_path(
        &self,
        from: usize,
        to: usize,
        table: &mut CalibrationTable,
        stats: &TransferStats,
    ) -> Result<()> {
        let largest = *CALIBRATION_SIZES.last().expect("sizes are listed");
        let src = DeviceBuffer::<u8>::zeroed(&self.device(from)?.context, largest)?;
        let mut dst = DeviceBuffer::<u8>::zeroed(&self.device(to)?.context, largest)?;
        for bytes in CALIBRATION_SIZES {
            let at = peer_measure(from, to, bytes);
            for &method in TransferMethod::candidates(TransferPath::PEER) {
                let gbps = typical_gbps(bytes, || {
                    self.run_with(
                        method,
                        Source::device(&src, 0, bytes),
                        Destination::Device(&mut dst, 0),
                        stats,
                    )
                });
                match gbps {
                    Ok(gbps) => table.record_at(at, method, gbps),
                    Err(TransferError::Unsupported { .. }) => {}
                    Err(error) => return Err(error),
                }
            }
        }
        Ok(())
    }
}

/// The location of host memory of `kind` used with device `d`.
fn host_location(kind: crate::LocationKind, d: usize) -> Location {
    match kind {
        crate::LocationKind::Pinned => Location::PinnedHost(d),
        _ => Location::PageableHost,
    }
}
