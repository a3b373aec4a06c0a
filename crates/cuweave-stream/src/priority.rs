//! [`StreamPriority`]: High, Normal and Low, mapped onto the device's own priority range.

use cuweave_driver::StreamPriorityRange;
use serde::{Deserialize, Serialize};

/// How urgently the GPU's block scheduler should pick a stream's kernels over other streams'.
///
/// CUDA priorities are integers where lower is more urgent, in a range that depends on the
/// device (`cuCtxGetStreamPriorityRange`; on an H100 it is `-5..=0`). The three levels map onto
/// it as: `High` = the greatest priority (numerically least), `Low` = the least (numerically
/// greatest), `Normal` = the midpoint, rounded toward zero (`-2` on an H100). Priority only
/// affects which pending thread blocks start first; it does not preempt running blocks and does
/// not reorder copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum StreamPriority {
    /// The device's greatest priority: latency-critical work.
    High,
    /// The middle of the device's range: ordinary work.
    Normal,
    /// The device's least priority (usually 0, CUDA's default): background work.
    Low,
}

impl StreamPriority {
    /// All levels, most urgent first.
    pub const ALL: [StreamPriority; 3] = [Self::High, Self::Normal, Self::Low];

    /// The driver priority this level maps to in `range`.
    pub fn to_driver(self, range: StreamPriorityRange) -> i32 {
        match self {
            Self::High => range.greatest,
            // Integer division truncates toward zero: -5..=0 gives -2 (in i64: any two i32
            // ends have a midpoint that is an i32, but not always a sum that is).
            Self::Normal => ((i64::from(range.greatest) + i64::from(range.least)) / 2) as i32,
            Self::Low => range.least,
        }
    }

    /// The level whose driver priority is closest to `priority` in `range` (ties go to the more
    /// urgent level), e.g. to classify a stream made elsewhere.
    pub fn from_driver(priority: i32, range: StreamPriorityRange) -> Self {
        let priority = range.clamp(priority);
        Self::ALL
            .into_iter()
            .min_by_key(|level| level.to_driver(range).abs_diff(priority))
            .unwrap_or(Self::Normal)
    }

    /// Index of the level in [`ALL`](Self::ALL).
    pub(crate) fn index(self) -> usize {
        match self {
            Self::High => 0,
            Self::Normal => 1,
            Self::Low => 2,
        }
    }
}

impl std::fmt::Display for StreamPriority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::High => "high",
            Self::Normal => "normal",
            Self::Low => "low",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    const H100: StreamPriorityRange = StreamPriorityRange {
        least: 0,
        greatest: -5,
    };
    const FLAT: StreamPriorityRange = StreamPriorityRange {
        least: 0,
        greatest: 0,
    };

    #[rstest]
    #[case(H100, StreamPriority::High, -5)]
    #[case(H100, StreamPriority::Normal, -2)]
    #[case(H100, StreamPriority::Low, 0)]
    #[case(StreamPriorityRange { least: 0, greatest: -1 }, StreamPriority::Normal, 0)]
    #[case(FLAT, StreamPriority::High, 0)]
    #[case(FLAT, StreamPriority::Low, 0)]
    fn levels_map_onto_the_device_range(
        #[case] range: StreamPriorityRange,
        #[case] level: StreamPriority,
        #[case] expected: i32,
    ) {
        assert_eq!(level.to_driver(range), expected);
        assert!(range.contains(level.to_driver(range)));
    }

    #[rstest]
    #[case(-5, StreamPriority::High)]
    #[case(-4, StreamPriority::High)]
    #[case(-2, StreamPriority::Normal)]
    #[case(-1, StreamPriority::Normal)]
    #[case(0, StreamPriority::Low)]
    #[case(7, StreamPriority::Low)]
    #[case(-9, StreamPriority::High)]
    fn driver_priorities_classify_to_the_nearest_level(
        #[case] priority: i32,
        #[case] expected: StreamPriority,
    ) {
        assert_eq!(StreamPriority::from_driver(priority, H100), expected);
    }

    #[test]
    fn levels_round_trip() {
        for level in StreamPriority::ALL {
            assert_eq!(
                StreamPriority::from_driver(level.to_driver(H100), H100),
                level
            );
            assert_eq!(StreamPriority::ALL[level.index()], level);
        }
    }
}
