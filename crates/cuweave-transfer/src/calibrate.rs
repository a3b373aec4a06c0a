//! Measuring this machine: [`TransferManager::calibrate`] times each candidate method per path
//! and size class, once per process.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cuweave_memory::{DeviceBuffer, PinnedBuffer};
use parking_lot::Mutex;

use crate::calibration::{CalibrationTable, RegistrationCost};
use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::location::{SizeClass, TransferPath};
use crate::manager::TransferManager;
use crate::method::TransferMethod;

/// The calibration measured in this process, shared by every manager created after it.
static PROCESS: OnceLock<Mutex<Option<CalibrationTable>>> = OnceLock::new();

pub(crate) fn process_calibration() -> Option<CalibrationTable> {
    PROCESS.get().and_then(|cell| cell.lock().clone())
}

fn remember(table: &CalibrationTable) {
    *PROCESS.get_or_init(|| Mutex::new(None)).lock() = Some(table.clone());
}

/// The two sizes registration is timed at, to fit its fixed part and its part per MiB.
const REGISTRATION_SIZES: [usize; 2] = [4 << 20, 64 << 20];
/// Registrations timed per size; the fastest counts.
const REGISTRATION_RUNS: usize = 2;

/// Repetitions per measurement: the best of these is kept (after one untimed warm-up run).
fn repetitions(bytes: usize) -> usize {
    if bytes <= 1 << 20 { 8 } else { 3 }
}

fn best_gbps(bytes: usize, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    let mut best = Duration::MAX;
    for _ in 0..repetitions(bytes) {
        let start = Instant::now();
        run()?;
        best = best.min(start.elapsed());
    }
    Ok(bytes as f64 / best.as_secs_f64().max(1e-9) / 1e9)
}

impl TransferManager {
    /// The calibration for this machine: measured once per process (each candidate method of
    /// the pageable, pinned, registered and peer paths of device 0 — and of every device pair —
    /// at each size class's [`SizeClass::calibration_bytes`], and the cost of registering host
    /// memory, from `cuMemHostRegister` + `cuMemHostUnregister` of a 4 MiB and a 64 MiB
    /// pageable buffer; a few hundred milliseconds on an H100), then reused by this and every
    /// later manager. The result is also in use by this manager.
    ///
    /// Where the driver cannot register host memory, the registration figures are left out
    /// (with a `tracing` warning) and the rest is measured as usual.
    ///
    /// # Errors
    /// The driver's or memory layer's error when a measurement fails (nothing is cached then).
    pub fn calibrate(&self) -> Result<CalibrationTable> {
        if let Some(table) = process_calibration() {
            self.set_measured(table.clone());
            return Ok(table);
        }
        self.recalibrate()
    }

    /// Measures again even if this process already calibrated (see [`calibrate`](Self::calibrate)).
    ///
    /// # Errors
    /// As [`calibrate`](Self::calibrate).
    pub fn recalibrate(&self) -> Result<CalibrationTable> {
        let mut table = CalibrationTable {
            device: Some(cuweave_driver::Device::get(0)?.name()?),
            ..CalibrationTable::default()
        };
        if self.device_count() > 0 {
            self.measure_host_paths(&mut table)?;
        }
        for (a, b) in
            (0..self.device_count()).flat_map(|a| (0..self.device_count()).map(move |b| (a, b)))
        {
            if a != b {
                self.measure_peer_path(a, b, &mut table)?;
            }
        }
        remember(&table);
        self.set_measured(table.clone());
        tracing::info!(
            entries = table.entries.len(),
            "transfer calibration measured"
        );
        Ok(table)
    }

    fn measure_host_paths(&self, table: &mut CalibrationTable) -> Result<()> {
        let context = &self.device(0).context;
        let largest = SizeClass::Huge.calibration_bytes();
        let mut device = DeviceBuffer::<u8>::zeroed(context, largest)?;
        let mut pinned = PinnedBuffer::<u8>::zeroed(context, largest)?;
        let mut host = vec![1u8; largest];
        for class in SizeClass::ALL {
            let bytes = class.calibration_bytes();
            for (path, methods) in [
                (
                    TransferPath::PAGEABLE_TO_DEVICE,
                    TransferMethod::candidates(TransferPath::PAGEABLE_TO_DEVICE),
                ),
                (
                    TransferPath::DEVICE_TO_PAGEABLE,
                    TransferMethod::candidates(TransferPath::DEVICE_TO_PAGEABLE),
                ),
                (
                    TransferPath::PINNED_TO_DEVICE,
                    TransferMethod::candidates(TransferPath::PINNED_TO_DEVICE),
                ),
                (
                    TransferPath::DEVICE_TO_PINNED,
                    TransferMethod::candidates(TransferPath::DEVICE_TO_PINNED),
                ),
            ] {
                for &method in methods {
                    let gbps = best_gbps(bytes, || {
                        match path {
                            p if p == TransferPath::PAGEABLE_TO_DEVICE => self.transfer_with(
                                method,
                                &host[..bytes],
                                Destination::Device(&mut device, 0),
                            ),
                            p if p == TransferPath::DEVICE_TO_PAGEABLE => self.transfer_with(
                                method,
                                Source::device(&device, 0, bytes),
                                Destination::Host(&mut host[..bytes]),
                            ),
                            p if p == TransferPath::PINNED_TO_DEVICE => self.transfer_with(
                                method,
                                Source::pinned(&pinned, 0, bytes),
                                Destination::Device(&mut device, 0),
                            ),
                            _ => self.transfer_with(
                                method,
                                Source::device(&device, 0, bytes),
                                Destination::Pinned(&mut pinned, 0),
                            ),
                        }
                        .map(drop)
                    });
                    match gbps {
                        Ok(gbps) => table.record(path, class, method, gbps),
                        // A method the devices cannot do is not a candidate; skip it.
                        Err(crate::TransferError::Unsupported { .. }) => {}
                        Err(error) => return Err(error),
                    }
                }
            }
        }
        match self.measure_registration(&mut host, &mut device, table) {
            Ok(()) => {}
            // The driver refused to register (or unregister) host memory: leave the
            // registration figures out rather than the whole calibration.
            Err(TransferError::Driver(error)) => {
                tracing::warn!(%error, "host registration not calibrated");
            }
            Err(error) => return Err(error),
        }
        // Calibration does not count as traffic.
        self.stats().reset();
        Ok(())
    }

    /// The cost of registering (fitted through [`REGISTRATION_SIZES`]) and the registered
    /// paths' `DirectCopy` per size class, with `host` (pageable, every page touched)
    /// page-locked in place.
    fn measure_registration(
        &self,
        host: &mut [u8],
        device: &mut DeviceBuffer<u8>,
        table: &mut CalibrationTable,
    ) -> Result<()> {
        let [small, large] = REGISTRATION_SIZES;
        let mut time = |bytes: usize| -> Result<Duration> {
            let mut best = Duration::MAX;
            for _ in 0..REGISTRATION_RUNS {
                let start = Instant::now();
                self.register_host(0, &mut host[..bytes])?.unregister()?;
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
        table.registration = Some(cost);

        let method = TransferMethod::DirectCopy;
        let mut registered = self.register_host(0, host)?;
        for class in SizeClass::ALL {
            let bytes = class.calibration_bytes();
            let up = best_gbps(bytes, || {
                self.transfer_with(
                    method,
                    Source::registered(&registered, 0, bytes),
                    Destination::Device(&mut *device, 0),
                )
                .map(drop)
            })?;
            table.record(TransferPath::REGISTERED_TO_DEVICE, class, method, up);
            let down = best_gbps(bytes, || {
                self.transfer_with(
                    method,
                    Source::device(device, 0, bytes),
                    Destination::registered(&mut registered, 0),
                )
                .map(drop)
            })?;
            table.record(TransferPath::DEVICE_TO_REGISTERED, class, method, down);
        }
        registered.unregister()?;
        Ok(())
    }

    fn measure_peer_path(
        &self,
        from: usize,
        to: usize,
        table: &mut CalibrationTable,
    ) -> Result<()> {
        let largest = SizeClass::Huge.calibration_bytes();
        let src = DeviceBuffer::<u8>::zeroed(&self.device(from).context, largest)?;
        let mut dst = DeviceBuffer::<u8>::zeroed(&self.device(to).context, largest)?;
        for class in SizeClass::ALL {
            let bytes = class.calibration_bytes();
            for &method in TransferMethod::candidates(TransferPath::PEER) {
                let gbps = best_gbps(bytes, || {
                    self.transfer_with(
                        method,
                        Source::device(&src, 0, bytes),
                        Destination::Device(&mut dst, 0),
                    )
                    .map(drop)
                });
                match gbps {
                    Ok(gbps) => table.record(TransferPath::PEER, class, method, gbps),
                    Err(crate::TransferError::Unsupported { .. }) => {}
                    Err(error) => return Err(error),
                }
            }
        }
        self.stats().reset();
        Ok(())
    }
}
