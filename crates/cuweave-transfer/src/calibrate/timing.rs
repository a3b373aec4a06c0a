//! How calibration times what it measures: the median of a few runs ([`typical_gbps`]), and
//! the rounds in which the staging candidates are measured side by side ([`RoundShape`]).

use std::time::{Duration, Instant};

use crate::error::Result;

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
pub(super) fn typical_gbps(bytes: usize, mut run: impl FnMut() -> Result<()>) -> Result<f64> {
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
pub(super) fn median_gbps(bytes: usize, times: &mut [Duration]) -> f64 {
    times.sort();
    let median = times[times.len() / 2];
    bytes as f64 / median.as_secs_f64().max(1e-9) / 1e9
}

/// How a calibration round measures each staging candidate at one size: `runs` runs in a row,
/// the first `untimed` of them not timed, in each of `rounds` rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RoundShape {
    pub(super) rounds: usize,
    pub(super) runs: usize,
    pub(super) untimed: usize,
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
    pub(super) fn at(bytes: usize) -> Self {
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
    pub(super) fn timed(self) -> usize {
        self.rounds * (self.runs - self.untimed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
