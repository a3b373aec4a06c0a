//! [`RegistrationCost`]: what page-locking host memory in place costs here.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// What page-locking a host buffer in place costs: `cuMemHostRegister` plus the matching
/// `cuMemHostUnregister`, as a fixed part and a part per MiB, fitted by
/// [`calibrate`](crate::TransferManager::calibrate) through two measured sizes.
///
/// ```
/// use std::time::Duration;
/// use cuweave_transfer::RegistrationCost;
///
/// let cost = RegistrationCost::fit(
///     (4 << 20, Duration::from_millis(11)),
///     (64 << 20, Duration::from_millis(20)),
/// );
/// assert_eq!((cost.fixed_ms, cost.ms_per_mib), (10.4, 0.15));
/// assert!((cost.millis(128 << 20) - 29.6).abs() < 1e-9); // 10.4 + 128 * 0.15
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RegistrationCost {
    /// Milliseconds paid whatever the size.
    pub fixed_ms: f64,
    /// Milliseconds per MiB (2^20 bytes) registered.
    pub ms_per_mib: f64,
}

impl RegistrationCost {
    /// The cost assumed until [`calibrate`](crate::TransferManager::calibrate) measures it on
    /// this machine: the H100 host's, as its calibration measured it (0.247 ms + 0.0720 ms per
    /// MiB; registering and unregistering 64 MiB took 4.57 ms raw and 4.65 ms through
    /// [`register_host`](crate::TransferManager::register_host) in the same run; see
    /// `docs/transfer.md`).
    pub const H100_DEFAULT: Self = Self {
        fixed_ms: 0.25,
        ms_per_mib: 0.072,
    };

    /// The line through two measurements `(bytes, time)` (in any order), with neither part
    /// negative (measurement noise can tilt the line), rounded to 0.001 ms.
    pub fn fit(a: (usize, Duration), b: (usize, Duration)) -> Self {
        let (small, large) = if a.0 <= b.0 { (a, b) } else { (b, a) };
        let mib = |bytes: usize| bytes as f64 / (1u64 << 20) as f64;
        let ms = |time: Duration| time.as_secs_f64() * 1e3;
        let span = mib(large.0) - mib(small.0);
        let ms_per_mib = if span > 0.0 {
            ((ms(large.1) - ms(small.1)) / span).max(0.0)
        } else {
            0.0
        };
        let fixed_ms = (ms(small.1) - ms_per_mib * mib(small.0)).max(0.0);
        let round = |x: f64| (x * 1e3).round() / 1e3;
        Self {
            fixed_ms: round(fixed_ms),
            ms_per_mib: round(ms_per_mib),
        }
    }

    /// Milliseconds to register and unregister `bytes`.
    pub fn millis(&self, bytes: usize) -> f64 {
        self.fixed_ms + self.ms_per_mib * bytes as f64 / (1u64 << 20) as f64
    }

    /// The time to register and unregister `bytes`.
    pub fn duration(&self, bytes: usize) -> Duration {
        // `max` also turns a NaN (from a hand-edited file) into zero; no panic either way.
        Duration::try_from_secs_f64((self.millis(bytes) / 1e3).max(0.0)).unwrap_or(Duration::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_costs_fit_two_points_and_never_go_negative() {
        let ms = Duration::from_millis;
        let cost = RegistrationCost::fit((64 << 20, ms(20)), (4 << 20, ms(11)));
        assert_eq!(
            cost,
            RegistrationCost {
                fixed_ms: 10.4,
                ms_per_mib: 0.15
            }
        );
        assert!((cost.millis(64 << 20) - 20.0).abs() < 1e-9);
        // Noise: the larger buffer registered faster. No negative slope, no negative fixed part.
        let cost = RegistrationCost::fit((4 << 20, ms(12)), (64 << 20, ms(11)));
        assert_eq!((cost.fixed_ms, cost.ms_per_mib), (12.0, 0.0));
        let cost = RegistrationCost::fit((4 << 20, ms(1)), (64 << 20, ms(31)));
        assert_eq!((cost.fixed_ms, cost.ms_per_mib), (0.0, 0.5));
        // One size twice: all of it is fixed.
        let cost = RegistrationCost::fit((8 << 20, ms(3)), (8 << 20, ms(5)));
        assert_eq!((cost.fixed_ms, cost.ms_per_mib), (3.0, 0.0));
    }
}
