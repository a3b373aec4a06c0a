//! Measuring this machine: [`TransferManager::calibrate`] times each candidate method per path,
//! device (or device pair) and size, and chooses a staging configuration per size, once per
//! process.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use cuweave_memory::{DeviceBuffer, PinnedBuffer};
use parking_lot::Mutex;

use crate::calibration::{CalibrationTable, Measure, RegistrationCost, StagingChoice};
use crate::endpoint::{Destination, Source};
use crate::error::{Result, TransferError};
use crate::location::{Location, TransferPath};
use crate::manager::{TransferManager, pipeline};
use crate::method::TransferMethod;
use crate::planner;
use crate::staging::{ChunkOrder, StagingConfig};
use crate::stats::TransferStats;

/// The calibration measured in this process, shared by every manager created after it.
static PROCESS: OnceLock<Mutex<Option<CalibrationTable>>> = OnceLock::new();

pub(crate) fn process_calibration() -> Option<CalibrationTable> {
    PROCESS.get().and_then(|cell| cell.lock().clone())
}

fn remember(table: &CalibrationTable) {
    *PROCESS.get_or_init(|| Mutex::new(None)).lock() = Some(table.clone());
}

/// Held while a calibration measures: one at a time in a process.
static CALIBRATING: Mutex<()> = Mutex::new(());

/// What a table lacks for a manager's devices: the devices whose host paths it has not
/// measured, and the ordered pairs of them whose peer path it has not.
#[derive(Debug, PartialEq)]
struct Missing {
    devices: Vec<usize>,
    pairs: Vec<(usize, usize)>,
}

impl Missing {
    /// Everything, for a table not measured yet.
    fn all(devices: &[usize]) -> Self {
        Self::where_not(devices, |_| false, |_, _| false)
    }

    /// What `table` lacks: a device counts as measured when its pageable uploads are, a pair
    /// when its peer copies are.
    fn of(table: &CalibrationTable, devices: &[usize]) -> Self {
        let has = |path, src, dst| {
            table
                .entries
                .iter()
                .any(|e| e.path == path && e.src_device == src && e.dst_device == dst)
        };
        Self::where_not(
            devices,
            |d| has(TransferPath::PAGEABLE_TO_DEVICE, None, Some(d)),
            |a, b| has(TransferPath::PEER, Some(a), Some(b)),
        )
    }

    fn where_not(
        devices: &[usize],
        measured: impl Fn(usize) -> bool,
        pair_measured: impl Fn(usize, usize) -> bool,
    ) -> Self {
        Self {
            devices: devices.iter().copied().filter(|&d| !measured(d)).collect(),
            pairs: devices
                .iter()
                .flat_map(|&a| devices.iter().map(move |&b| (a, b)))
                .filter(|&(a, b)| a != b && !pair_measured(a, b))
                .collect(),
        }
    }

    fn is_empty(&self) -> bool {
        self.devices.is_empty() && self.pairs.is_empty()
    }
}

/// The transfer sizes calibration measures, each at its own size: every size class is
/// represented (64 KiB up to 1 GiB), so the method choice compares methods at the measured size
/// nearest each transfer. Up to 4 MiB every factor of two: there the pipeline's margin over
/// the plain call is thinnest (1.1-2x on the H100 host), and a size between two measured ones
/// took a choice measured at twice or half its size (512 KiB uploads ran 0.93-1.09x the plain
/// call on the 256 KiB and 1 MiB choices); above, where it runs 2-7x, every factor of four.
pub const CALIBRATION_SIZES: [usize; 11] = [
    64 << 10,
    128 << 10,
    256 << 10,
    512 << 10,
    1 << 20,
    2 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
    1 << 30,
];

/// The two sizes registration is timed at, to fit its fixed part and its part per MiB.
const REGISTRATION_SIZES: [usize; 2] = [4 << 20, 64 << 20];
/// Registrations timed per size; the fastest counts.
const REGISTRATION_RUNS: usize = 2;

/// Timed repetitions per measurement (after one untimed warm-up run); their median is kept.
fn repetitions(bytes: usize) -> usize {
    match bytes {
        b if b <= 1 << 20 => 9,
        _ => 5,
    }
}

/// The median bandwidth of [`repetitions`] runs: what a transfer typically gets, not the best
/// the host allowed once. On a shared host the best of a few runs favours the configurations
/// whose runs scatter most (many participants, any of which the scheduler may stall), which
/// then run far below their best figure most of the time.
fn typical_gbps(bytes: usize, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
    run()?;
    let mut times = Vec::with_capacity(repetitions(bytes));
    for _ in 0..repetitions(bytes) {
        let start = Instant::now();
        run()?;
        times.push(start.elapsed());
    }
    Ok(median_gbps(bytes, &mut times))
}

/// The bandwidth of moving `bytes` in the median of `times` (sorted here; not empty).
fn median_gbps(bytes: usize, times: &mut [Duration]) -> f64 {
    times.sort();
    let median = times[times.len() / 2];
    bytes as f64 / median.as_secs_f64().max(1e-9) / 1e9
}

/// How a calibration round measures each staging candidate at one size: `runs` runs in a row,
/// the first `untimed` of them not timed, in each of `rounds` rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RoundShape {
    rounds: usize,
    runs: usize,
    untimed: usize,
}

/// The largest size whose calibration rounds run each candidate several times in a row.
const RUNS_IN_A_ROW_MOST: usize = 1 << 20;

impl RoundShape {
    /// Up to [`RUNS_IN_A_ROW_MOST`], five rounds of one untimed and three timed runs of each
    /// candidate, each candidate's runs once the workers of the one before have stopped
    /// spinning; above it, [`repetitions`] rounds of one timed run each.
    ///
    /// A copy of a few tens of microseconds is slowed by whatever ran just before it: on the
    /// H100 host, a 256 KiB one-block upload measured 4.5 GB/s one run a round, after the
    /// pipelined candidates (whose workers spin on for a while, whose blocks and streams it
    /// shares), and 8.5 GB/s run after run, as a loop of such uploads runs; calibration then
    /// chose the plain call, 3-8 % under itself through the manager, where staging was 10 %
    /// over it. At 4 MiB both ways measured alike.
    fn at(bytes: usize) -> Self {
        if bytes <= RUNS_IN_A_ROW_MOST {
            Self {
                rounds: 5,
                runs: 4,
                untimed: 1,
            }
        } else {
            Self {
                rounds: repetitions(bytes),
                runs: 1,
                untimed: 0,
            }
        }
    }

    /// Timed runs per candidate.
    fn timed(self) -> usize {
        self.rounds * (self.runs - self.untimed)
    }
}

/// How much faster than the default another staging configuration must measure, round by
/// round, to replace it: the defaults come from many runs of the staging sweep, a calibration
/// from a few.
const DEFAULT_KEPT_WITHIN: f64 = 0.05;

/// In how many of the rounds (a fraction, rounded up) another staging configuration must beat
/// the default by more than [`DEFAULT_KEPT_WITHIN`] to replace it: every one.
const REPLACING_ROUNDS: f64 = 1.0;

/// Which of the staging candidates calibration keeps, from each candidate's bandwidth in each
/// round (`rounds[i][r]`; every candidate ran once in every round, one after another): the
/// default (candidate `default`) unless another beat it by more than [`DEFAULT_KEPT_WITHIN`]
/// in [`REPLACING_ROUNDS`] of the rounds, then the one of those with the highest median ratio
/// to the default; with no default among them, the one with the highest median.
///
/// Round by round, because a disturbed stretch of a shared host slows every candidate of a
/// round alike, and the ratio to the default that ran beside it cancels that out; every round,
/// by a clear margin, because with a dozen candidates of about equal speed at each of sixteen
/// sizes and directions, one of them is a few percent over the default in most rounds by
/// chance alone. In eight bench runs on the H100 host (fourteenth pass, three leases; the
/// summary names the configuration calibration chose), the highest-median rule replaced the
/// default in 19 of 24 choices at 16, 64 and 256 MiB uploads, with ten different winners (at
/// 64 MiB 8 MiB x 8, 4 MiB x 8, 4 MiB x 7 interleaved, 8 MiB x 5). Ahead by 3 % in four
/// rounds of five still replaced one or two defaults a run (fifteenth pass: 256 MiB uploads on
/// 8 MiB chunks then ran at 30.2 GB/s in the bench, against 50-50.5 with the default in the
/// runs beside it; 16 MiB downloads on eight participants at 36.2 against 40.9-41.2); where a
/// host's defaults are really wrong, the others win every round by far more (on a disturbed
/// lease, 1.2-2.3 times the default's figure). See docs/transfer.md.
fn choose_staging(rounds: &[Vec<f64>], default: Option<usize>) -> usize {
    let median = |values: &[f64]| {
        let mut values = values.to_vec();
        values.sort_by(f64::total_cmp);
        values.get(values.len() / 2).copied().unwrap_or(0.0)
    };
    let Some(d) = default else {
        return (0..rounds.len())
            .max_by(|&a, &b| median(&rounds[a]).total_cmp(&median(&rounds[b])))
            .expect("at least one candidate");
    };
    let base = &rounds[d];
    let needed = ((base.len() as f64 * REPLACING_ROUNDS).ceil() as usize).max(1);
    (0..rounds.len())
        .filter(|&i| i != d)
        .filter_map(|i| {
            let ratios: Vec<f64> = rounds[i]
                .iter()
                .zip(base)
                .map(|(candidate, default)| candidate / default.max(f64::MIN_POSITIVE))
                .collect();
            let wins = ratios
                .iter()
                .filter(|&&ratio| ratio > 1.0 + DEFAULT_KEPT_WITHIN)
                .count();
            (wins >= needed).then(|| (i, median(&ratios)))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(d, |(i, _)| i)
}

/// The pipeline's and the plain call's figures to record, from a first measurement
/// `(staged, direct)`: as measured when the pipeline was as fast or faster; when the plain call
/// measured faster, those of a second measurement (`again`), whichever it finds faster.
///
/// The plain call then runs every such transfer of the process, so that finding stands only if
/// a second measurement finds it again. On a disturbed stretch of the H100 host one calibration
/// measured the plain call faster at 16 MiB downloads, which then ran at 7.2 GB/s, where the
/// pipeline ran at 30.9 in the next process on the same lease.
fn confirmed(
    staged: f64,
    direct: f64,
    again: impl FnOnce() -> Result<(f64, f64)>,
) -> Result<(f64, f64)> {
    if direct > staged {
        again()
    } else {
        Ok((staged, direct))
    }
}

/// Which of `candidates` runs a copy of `bytes` as the default `base` does: `base` itself, or,
/// where `base`'s chunk holds the whole copy (one block, on the calling thread, whatever its
/// participants, depth and order), the one-block candidate with its host copy.
///
/// Without the second rule the default went unrecognised at 256 KiB, where the candidates
/// hold the one-block run as `256 KiB x 1` and the default is `256 KiB x 2`: calibration then
/// took the highest median with no margin, and on the H100 host chose 128 KiB chunks for
/// 256 KiB downloads in one calibration of six (and in bench runs), which then ran at
/// 0.99 times the plain call, against 1.3-1.6 times for the one block.
fn default_candidate(
    candidates: &[StagingConfig],
    base: StagingConfig,
    bytes: usize,
) -> Option<usize> {
    candidates.iter().position(|&c| c == base).or_else(|| {
        candidates.iter().position(|c| {
            c.runs_as_one_block(bytes)
                && base.runs_as_one_block(bytes)
                && c.host_copy == base.host_copy
        })
    })
}

/// The largest size whose calibration also tries a single block of the whole size.
const ONE_BLOCK_MOST: usize = 1 << 20;

/// The staging configurations tried for `path` at `bytes`: the default
/// ([`StagingConfig::for_path`]) with half, the same and double its chunk, each with half, the
/// same and double its participants (at most this machine's host threads, and at most
/// [`ORDERED_MOST`](crate::ORDERED_MOST) ordered), then the default with the other
/// [`HostCopy`](crate::HostCopy) (which one wins depends on the host's cache), and, for sizes
/// that run ordered, the other [`ChunkOrder`]: beside an ordered default the
/// [`Interleaved`](ChunkOrder::Interleaved) one with its participants and half as many again,
/// beside an interleaved default the ordered one with as many participants as it takes and two
/// thirds of that, and on chunks twice as large (which order wins depends on the size and the
/// host); up to 1 MiB, one block of the whole size with each host copy.
pub fn staging_candidates(path: TransferPath, bytes: usize) -> Vec<StagingConfig> {
    let base = StagingConfig::for_path(path, bytes);
    let most = crate::staging::most_participants(bytes, base.order);
    let mut out = Vec::new();
    for chunk in [base.chunk_bytes / 2, base.chunk_bytes, base.chunk_bytes * 2] {
        if chunk < (64 << 10) || chunk >= bytes {
            continue;
        }
        for threads in [base.threads.div_ceil(2), base.threads, base.threads * 2] {
            let config = StagingConfig {
                chunk_bytes: chunk,
                threads: threads.clamp(1, most),
                ..base
            };
            if !out.contains(&config) {
                out.push(config);
            }
        }
    }
    if out.is_empty() {
        out.push(base);
    }
    // The other host copy at the default (or, when the default's chunk does not fit the size,
    // at the first candidate).
    let pivot = if out.contains(&base) { base } else { out[0] };
    let other = StagingConfig {
        host_copy: match pivot.host_copy {
            crate::HostCopy::Streaming => crate::HostCopy::Cached,
            crate::HostCopy::Cached => crate::HostCopy::Streaming,
        },
        ..pivot
    };
    out.push(other);
    // Small sizes also try one block of the whole size (no pipeline, no worker), with each host
    // copy: at 256 KiB on the H100 host it matched the plain call where two chunks lost to it.
    if bytes <= ONE_BLOCK_MOST {
        for host_copy in [crate::HostCopy::Streaming, crate::HostCopy::Cached] {
            // A chunk of at least the whole size runs as one block already.
            if !out
                .iter()
                .any(|c| c.runs_as_one_block(bytes) && c.host_copy == host_copy)
            {
                out.push(StagingConfig {
                    chunk_bytes: bytes,
                    threads: 1,
                    host_copy,
                    ..base
                });
            }
        }
    }
    // At sizes that can run ordered, the other chunk order too: beside an ordered default the
    // interleaved pipeline with its participants and half as many again; beside an interleaved
    // one the ordered pipeline with as many as it takes and two thirds of that, and with as many
    // on chunks twice as large (all participants fill each ordered chunk, so it wants larger
    // ones: at 256 MiB on the H100 host, 4 MiB x 8 ordered ran 49.2-49.9 GB/s against 46.3-46.8
    // for the interleaved default on a calm lease, and less steadily on a disturbed one).
    let (order, tried): (ChunkOrder, Vec<(usize, usize)>) = if pivot.order.runs_ordered(bytes) {
        let all = crate::staging::most_participants(bytes, ChunkOrder::Interleaved);
        let more = pivot.threads + pivot.threads / 2;
        let tried = [pivot.threads, more].map(|t| (pivot.chunk_bytes, t.clamp(1, all)));
        (ChunkOrder::Interleaved, tried.into())
    } else if ChunkOrder::Ordered.runs_ordered(bytes) {
        let most = crate::staging::most_participants(bytes, ChunkOrder::Ordered);
        let threads = pivot.threads.clamp(1, most);
        let mut tried = vec![
            (pivot.chunk_bytes, threads),
            (pivot.chunk_bytes, (threads * 2).div_ceil(3)),
        ];
        if pivot.chunk_bytes * 2 < bytes {
            tried.push((pivot.chunk_bytes * 2, threads));
        }
        (ChunkOrder::Ordered, tried)
    } else {
        (pivot.order, Vec::new())
    };
    for (chunk_bytes, threads) in tried {
        let config = StagingConfig {
            order,
            chunk_bytes,
            threads,
            ..pivot
        };
        if !out.contains(&config) {
            out.push(config);
        }
    }
    out
}

impl TransferManager {
    /// The calibration for this machine: measured once per process, then reused by this and
    /// every later manager, and in use by this manager.
    ///
    /// For every device the manager serves: each candidate method of the pageable, pinned and
    /// registered host paths at each of [`CALIBRATION_SIZES`] (each size class at its own
    /// sizes, 1 GiB included), and for pageable copies a [`StagingConfig`] of
    /// [`staging_candidates`] per size (the default unless another was faster round after round;
    /// see `choose_staging`); for every ordered pair of devices, the peer path's
    /// candidates; and once, the cost of registering host memory (`cuMemHostRegister` +
    /// `cuMemHostUnregister` of 4 MiB and 64 MiB). A few seconds per device on an H100; save
    /// the table ([`CalibrationTable::save`]) to skip it next time.
    ///
    /// The measuring transfers are counted in calibration's own statistics, never in
    /// [`stats`](Self::stats). Where the driver cannot register host memory, the registration
    /// figures are left out (with a `tracing` warning).
    ///
    /// The process's table is shared by managers serving different devices: a manager whose
    /// devices (or device pairs) it does not cover yet measures those, and only those, into
    /// it. One calibration runs at a time in a process (a second waits for the first, so that
    /// neither skews the other's timings).
    ///
    /// # Errors
    /// The driver's or memory layer's error when a measurement fails (nothing is cached then).
    pub fn calibrate(&self) -> Result<CalibrationTable> {
        // A table that covers this manager is used without waiting for a calibration that
        // another manager may be running.
        if let Some(table) = process_calibration()
            && Missing::of(&table, &self.devices()).is_empty()
        {
            self.set_measured(table.clone());
            return Ok(table);
        }
        let _alone = CALIBRATING.lock();
        // Taken again under the lock: the calibration waited for may have measured it all.
        self.measure_missing(process_calibration())
    }

    /// Measures again even if this process already calibrated (see [`calibrate`](Self::calibrate)):
    /// also the way to replace a table loaded from another machine.
    ///
    /// # Errors
    /// As [`calibrate`](Self::calibrate).
    pub fn recalibrate(&self) -> Result<CalibrationTable> {
        let _alone = CALIBRATING.lock();
        self.measure_missing(None)
    }

    /// Measures into `known` (a new table when `None`) what it lacks for this manager's
    /// devices: their host paths, every ordered pair's peer path, and the registration cost;
    /// then shares and uses the table.
    fn measure_missing(&self, known: Option<CalibrationTable>) -> Result<CalibrationTable> {
        let devices = self.devices();
        let missing = known
            .as_ref()
            .map_or_else(|| Missing::all(&devices), |t| Missing::of(t, &devices));
        if let (Some(table), true) = (&known, missing.is_empty()) {
            self.set_measured(table.clone());
            return Ok(table.clone());
        }
        let mut table = known.unwrap_or_else(|| {
            let machine = self.machine();
            CalibrationTable {
                device: machine.first().cloned(),
                devices: machine,
                ..CalibrationTable::default()
            }
        });
        let stats = TransferStats::default();
        for &device in &missing.devices {
            let with_registration = table.registration.is_none();
            self.measure_host_paths(device, with_registration, &mut table, &stats)?;
        }
        for &(a, b) in &missing.pairs {
            self.measure_peer_path(a, b, &mut table, &stats)?;
        }
        remember(&table);
        self.set_measured(table.clone());
        tracing::info!(
            entries = table.entries.len(),
            transfers = stats
                .snapshot()
                .iter()
                .map(|(_, _, s)| s.count)
                .sum::<u64>(),
            "transfer calibration measured"
        );
        Ok(table)
    }

    /// Runs `method` from `src` to `dst`, counted in calibration's own `stats`.
    fn run_with<T: cuweave_memory::Element>(
        &self,
        method: TransferMethod,
        src: Source<'_, T>,
        dst: Destination<'_, T>,
        stats: &TransferStats,
    ) -> Result<()> {
        let (from, to) = (src.location(), dst.location());
        let plan = planner::require(
            TransferPath::between(from, to),
            src.bytes(),
            &self.facts(from, to),
            method,
        )
        .map_err(|reason| TransferError::Unsupported {
            method,
            path: format!("{from} -> {to}"),
            reason,
        })?;
        self.run(plan, src, dst, stats).map(drop)
    }

    fn measure_host_paths(
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

    /// Tries every [`staging_candidates`] configuration for a pageable `path` at `bytes` on
    /// device `d`, and the plain call ([`TransferMethod::DirectCopy`]) in the same rounds;
    /// records the configuration `choose_staging` keeps as the size's staging choice, and
    /// returns its figure and the plain call's.
    #[allow(clippy::too_many_arguments)]
    fn tune_staging(
        &self,
        d: usize,
        path: TransferPath,
        bytes: usize,
        host: &mut [u8],
        device: &mut DeviceBuffer<u8>,
        table: &mut CalibrationTable,
        stats: &TransferStats,
    ) -> Result<(f64, f64)> {
        let lane = self.lane(d)?;
        let candidates = staging_candidates(path, bytes);
        let upload = path == TransferPath::PAGEABLE_TO_DEVICE;
        // `None` is the plain call, through the manager as a planned transfer runs it.
        let mut run = |way: Option<StagingConfig>| match way {
            Some(config) if upload => {
                pipeline(&lane, config).upload(&host[..bytes], &mut *device, 0)
            }
            Some(config) => pipeline(&lane, config).download(&*device, 0, &mut host[..bytes]),
            None if upload => self.run_with(
                TransferMethod::DirectCopy,
                Source::Host(&host[..bytes]),
                Destination::Device(&mut *device, 0),
                stats,
            ),
            None => self.run_with(
                TransferMethod::DirectCopy,
                Source::device(&*device, 0, bytes),
                Destination::Host(&mut host[..bytes]),
                stats,
            ),
        };
        let ways: Vec<Option<StagingConfig>> =
            candidates.iter().copied().map(Some).chain([None]).collect();
        // Round by round, every way in every round (after an untimed round): a disturbed
        // stretch of a shared host slows every candidate, and the plain call, alike, where
        // measuring one after another let one measured in a calm moment win (a 64 MiB upload
        // calibrated to 4 MiB x 4 ran at 21-31 GB/s, against about 40 for the default; a 1 MiB
        // upload, staged at 1.05-1.35x the plain call, was planned as the plain call). Small
        // sizes run each way a few times in a row within a round, the first untimed
        // (`RoundShape`).
        for &way in &ways {
            run(way)?;
        }
        let shape = RoundShape::at(bytes);
        // Each way's timed runs, in round order.
        let mut rounds_of = |ways: &[Option<StagingConfig>]| -> Result<Vec<Vec<Duration>>> {
            let mut times = vec![Vec::with_capacity(shape.timed()); ways.len()];
            for _ in 0..shape.rounds {
                for (i, &way) in ways.iter().enumerate() {
                    if shape.untimed > 0 {
                        // Not while the workers of the way before still spin.
                        crate::workers::wait_for_cold_workers(2 * crate::workers::WARM);
                    }
                    for timed in (0..shape.runs).map(|run| run >= shape.untimed) {
                        let start = Instant::now();
                        run(way)?;
                        if timed {
                            times[i].push(start.elapsed());
                        }
                    }
                }
            }
            Ok(times)
        };
        let mut times = rounds_of(&ways)?;
        // Each way's bandwidth per round (the median of its timed runs there), in round order.
        let per_round: Vec<Vec<f64>> = times
            .iter()
            .map(|t| {
                t.chunks((shape.runs - shape.untimed).max(1))
                    .map(|round| median_gbps(bytes, &mut round.to_vec()))
                    .collect()
            })
            .collect();
        let mut medians: Vec<f64> = times.iter_mut().map(|t| median_gbps(bytes, t)).collect();
        let direct = medians.pop().expect("the plain call is measured");
        tracing::debug!(device = d, %path, bytes, gbps = direct, "plain call measured");
        for ((config, gbps), rounds) in candidates.iter().zip(&medians).zip(&per_round) {
            tracing::debug!(device = d, %path, bytes, ?config, gbps, ?rounds, "staging candidate measured");
        }
        let chosen = choose_staging(
            &per_round[..candidates.len()],
            default_candidate(&candidates, StagingConfig::for_path(path, bytes), bytes),
        );
        let (config, gbps) = (candidates[chosen], medians[chosen]);
        let (gbps, direct) = confirmed(gbps, direct, || {
            let mut again = rounds_of(&[Some(config), None])?;
            let again = (
                median_gbps(bytes, &mut again[0]),
                median_gbps(bytes, &mut again[1]),
            );
            tracing::debug!(device = d, %path, bytes, ?config, ?again, "plain call faster: measured again");
            Ok(again)
        })?;
        table.record_staging(StagingChoice {
            path,
            device: d,
            bytes,
            config,
            gbps: (gbps * 100.0).round() / 100.0,
        });
        Ok((gbps, direct))
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
    fn measure_peer_path(
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

/// The calibration key of a copy of `bytes` from device `from` to device `to`.
pub fn peer_measure(from: usize, to: usize, bytes: usize) -> Measure {
    planner::Query::new(Location::Device(from), Location::Device(to), bytes).measure
}

/// The location of host memory of `kind` used with device `d`.
fn host_location(kind: crate::LocationKind, d: usize) -> Location {
    match kind {
        crate::LocationKind::Pinned => Location::PinnedHost(d),
        _ => Location::PageableHost,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calibration_measures_only_the_devices_and_pairs_its_table_lacks() {
        assert_eq!(
            Missing::all(&[0, 1]),
            Missing {
                devices: vec![0, 1],
                pairs: vec![(0, 1), (1, 0)],
            }
        );
        // A table measured by a manager limited to device 0 (or to none: empty).
        let mut table = CalibrationTable::default();
        assert_eq!(Missing::of(&table, &[0]), Missing::all(&[0]));
        assert!(Missing::of(&table, &[]).is_empty());
        let up = |d| planner::Query::new(Location::PageableHost, Location::Device(d), 4 << 20);
        table.record_at(up(0).measure, TransferMethod::HostStaged, 30.0);
        assert!(Missing::of(&table, &[0]).is_empty());
        // A manager for both devices then measures device 1 and the two pairs only.
        assert_eq!(
            Missing::of(&table, &[0, 1]),
            Missing {
                devices: vec![1],
                pairs: vec![(0, 1), (1, 0)],
            }
        );
        table.record_at(up(1).measure, TransferMethod::HostStaged, 30.0);
        table.record_at(
            peer_measure(0, 1, 4 << 20),
            TransferMethod::PeerToPeer,
            40.0,
        );
        assert_eq!(
            Missing::of(&table, &[0, 1]),
            Missing {
                devices: vec![],
                pairs: vec![(1, 0)],
            }
        );
        table.record_at(
            peer_measure(1, 0, 4 << 20),
            TransferMethod::PeerToPeer,
            40.0,
        );
        assert!(Missing::of(&table, &[0, 1]).is_empty());
        assert!(Missing::of(&table, &[1]).is_empty());
    }

    #[test]
    fn small_sizes_time_runs_in_a_row_after_an_untimed_one() {
        for bytes in [64 << 10, 256 << 10, 1 << 20] {
            let shape = RoundShape::at(bytes);
            assert!(
                shape.untimed >= 1 && shape.runs > shape.untimed,
                "{shape:?}"
            );
            assert!(shape.rounds >= 3, "{shape:?}");
            assert!(shape.timed() >= repetitions(bytes), "{shape:?}");
        }
        for bytes in [4 << 20, 64 << 20, 1 << 30] {
            let shape = RoundShape::at(bytes);
            assert_eq!((shape.runs, shape.untimed), (1, 0), "{shape:?}");
            assert_eq!(shape.timed(), repetitions(bytes));
        }
    }

    #[rstest::rstest]
    // The pipeline faster, or level: recorded as measured, nothing measured again.
    #[case::staging_faster((31.0, 7.2), None, (31.0, 7.2))]
    #[case::level((7.2, 7.2), None, (7.2, 7.2))]
    // The plain call faster: the second measurement decides, either way, with its own figures.
    #[case::a_disturbed_first_measurement((6.1, 7.2), Some((33.5, 7.4)), (33.5, 7.4))]
    #[case::found_again((6.1, 7.2), Some((6.4, 7.0)), (6.4, 7.0))]
    fn a_faster_plain_call_is_recorded_only_when_a_second_measurement_finds_it_again(
        #[case] first: (f64, f64),
        #[case] second: Option<(f64, f64)>,
        #[case] recorded: (f64, f64),
    ) {
        let mut measured_again = false;
        let figures = confirmed(first.0, first.1, || {
            measured_again = true;
            Ok(second.expect("measured again only when the plain call was faster"))
        })
        .unwrap();
        assert_eq!(figures, recorded);
        assert_eq!(measured_again, second.is_some());
        // The second measurement's error is calibration's error.
        let failed = confirmed(first.0, first.1, || Err(TransferError::WorkerPanicked));
        assert_eq!(failed.is_err(), second.is_some());
    }

    #[test]
    fn every_size_class_is_measured_at_its_own_size() {
        use crate::SizeClass;
        for class in SizeClass::ALL {
            assert!(
                CALIBRATION_SIZES.iter().any(|&b| SizeClass::of(b) == class),
                "{class}"
            );
        }
        assert!(CALIBRATION_SIZES.contains(&(1 << 30)));
    }

    #[rstest::rstest]
    // Another ahead of the default by more than 5 % in every round wins.
    #[case::default_behind(vec![vec![40.0; 5], vec![43.0; 5], vec![30.0; 5]], Some(0), 1)]
    // Within 5 % in every round, ahead by more in four rounds of five only, or in three (a
    // median 10 % over the default, which the highest-median rule took), the default stays.
    #[case::default_close(vec![vec![40.0; 5], vec![41.9; 5], vec![30.0; 5]], Some(0), 0)]
    #[case::four_of_five(
        vec![vec![40.0; 5], vec![43.0, 43.0, 43.0, 43.0, 41.0]],
        Some(0),
        0
    )]
    #[case::lucky_rounds(
        vec![vec![40.0; 5], vec![48.0, 47.0, 44.0, 38.0, 36.0]],
        Some(0),
        0
    )]
    #[case::default_fastest(vec![vec![40.0; 5], vec![39.0; 5], vec![38.0; 5]], Some(0), 0)]
    // A round that slowed every way alike does not hide a candidate ahead in each.
    #[case::disturbed_round(
        vec![vec![40.0, 40.0, 20.0, 40.0, 40.0], vec![44.0, 44.0, 22.0, 44.0, 44.0]],
        Some(0),
        1
    )]
    // Of two that qualify, the one further ahead of the default.
    #[case::two_qualify(
        vec![vec![40.0; 5], vec![44.0; 5], vec![50.0, 50.0, 50.0, 50.0, 42.5]],
        Some(0),
        2
    )]
    #[case::no_default(vec![vec![40.0; 5], vec![41.0; 5], vec![30.0; 5]], None, 1)]
    #[case::one_candidate(vec![vec![12.0; 5]], Some(0), 0)]
    #[case::one_round(vec![vec![40.0], vec![43.0]], Some(0), 1)]
    fn calibration_keeps_the_default_unless_another_is_faster_round_after_round(
        #[case] rounds: Vec<Vec<f64>>,
        #[case] default: Option<usize>,
        #[case] chosen: usize,
    ) {
        assert_eq!(choose_staging(&rounds, default), chosen);
    }

    #[test]
    fn the_default_is_among_the_candidates_at_every_size() {
        for &bytes in &CALIBRATION_SIZES {
            for path in [
                TransferPath::PAGEABLE_TO_DEVICE,
                TransferPath::DEVICE_TO_PAGEABLE,
            ] {
                let candidates = staging_candidates(path, bytes);
                let base = StagingConfig::for_path(path, bytes);
                let found = default_candidate(&candidates, base, bytes)
                    .unwrap_or_else(|| panic!("{path} {bytes}: no default among {candidates:?}"));
                let c = candidates[found];
                assert!(
                    c == base
                        || (c.runs_as_one_block(bytes)
                            && base.runs_as_one_block(bytes)
                            && c.host_copy == base.host_copy),
                    "{path} {bytes}: {c:?} does not run as {base:?}"
                );
            }
        }
        // At 256 KiB the default's 256 KiB chunk is the whole copy: it runs as the one-block
        // candidate, so a pipelined one must beat it round after round to replace it.
        let bytes = 256 << 10;
        let path = TransferPath::DEVICE_TO_PAGEABLE;
        let candidates = staging_candidates(path, bytes);
        let base = StagingConfig::for_path(path, bytes);
        assert!(!candidates.contains(&base), "{candidates:?}");
        let found = default_candidate(&candidates, base, bytes).expect("the one-block candidate");
        assert_eq!(candidates[found].chunk_bytes, bytes);
        // A split candidate ahead in four rounds of five, with the higher median, loses.
        let mut rounds = vec![vec![7.0; 5]; candidates.len()];
        let split = candidates
            .iter()
            .position(|c| c.chunk_bytes < bytes)
            .expect("a split candidate");
        rounds[found] = vec![6.96, 6.81, 6.84, 7.13, 7.91];
        rounds[split] = vec![7.34, 7.57, 7.96, 8.72, 5.42];
        assert_eq!(choose_staging(&rounds, Some(found)), found);
    }

    #[test]
    fn staging_candidates_are_distinct_and_fit_the_size() {
        for (&bytes, path) in CALIBRATION_SIZES.iter().flat_map(|b| {
            [
                TransferPath::PAGEABLE_TO_DEVICE,
                TransferPath::DEVICE_TO_PAGEABLE,
            ]
            .map(|p| (b, p))
        }) {
            let candidates = staging_candidates(path, bytes);
            assert!(candidates.len() >= 2);
            let kinds = |k| candidates.iter().filter(|c| c.host_copy == k).count();
            assert!(kinds(crate::HostCopy::Streaming) >= 1 && kinds(crate::HostCopy::Cached) >= 1);
            for (i, c) in candidates.iter().enumerate() {
                assert!(c.chunk_bytes > 0 && c.threads > 0 && c.depth > 0);
                assert!(!candidates[..i].contains(c));
                if c.order.runs_ordered(bytes) {
                    assert!(c.threads <= crate::staging::ORDERED_MOST, "{c:?}");
                }
            }
            // Small sizes measure one block of the whole size, with both host copies.
            let one_block = |k| {
                candidates
                    .iter()
                    .filter(|c| c.runs_as_one_block(bytes) && c.host_copy == k)
                    .count()
            };
            for k in [crate::HostCopy::Streaming, crate::HostCopy::Cached] {
                assert_eq!(
                    one_block(k),
                    usize::from(bytes <= ONE_BLOCK_MOST),
                    "{bytes} {k:?}"
                );
            }
            // From the ordered sizes both orders are measured.
            let orders = |o| candidates.iter().filter(|c| c.order == o).count();
            if bytes >= crate::staging::ORDERED_FROM {
                assert!(orders(ChunkOrder::Ordered) >= 1 && orders(ChunkOrder::Interleaved) >= 1);
            }
            // Beside an interleaved default that could run ordered, the ordered pipeline is also
            // tried on chunks twice the default's.
            let base = StagingConfig::for_path(path, bytes);
            if base.order == ChunkOrder::Interleaved
                && ChunkOrder::Ordered.runs_ordered(bytes)
                && base.chunk_bytes * 2 < bytes
            {
                assert!(
                    candidates.iter().any(|c| c.order == ChunkOrder::Ordered
                        && c.chunk_bytes == base.chunk_bytes * 2
                        && c.host_copy == base.host_copy),
                    "{bytes} {path:?}: {candidates:?}"
                );
            }
        }
    }
}
