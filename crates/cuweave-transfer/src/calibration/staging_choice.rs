//! [`StagingChoice`]: the staging configuration calibration chose per path, device and size,
//! and how a transfer finds the one that applies to it.

use serde::{Deserialize, Serialize};

use super::{CalibrationTable, size_distance};
use crate::location::TransferPath;
use crate::staging::StagingConfig;

/// The staging configuration calibration chose for one path, device and size: the size's default
/// unless another measured faster than it round after round.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StagingChoice {
    /// The path (pageable to device, or device to pageable).
    pub path: TransferPath,
    /// The device.
    pub device: usize,
    /// The size measured.
    pub bytes: usize,
    /// The configuration chosen there.
    pub config: StagingConfig,
    /// Its bandwidth, GB/s.
    pub gbps: f64,
}

impl CalibrationTable {
    /// Records the staging configuration chosen for `path` on `device` at `bytes`.
    pub fn record_staging(&mut self, choice: StagingChoice) {
        self.staging
            .retain(|c| (c.path, c.device, c.bytes) != (choice.path, choice.device, choice.bytes));
        self.staging.push(choice);
    }

    /// The staging configuration chosen for `path` on `device` at the size nearest
    /// `bytes` (log scale), if any was measured.
    ///
    /// A choice that ran as one block where it was measured (its chunk held that whole copy, on
    /// the calling thread) says nothing of how many participants a copy its chunk does not hold
    /// wants: such a copy takes the nearest choice that applies to it instead, and that one
    /// only when no other was measured. (On the H100 host a 256 KiB choice of one 256 KiB
    /// block ran 512 KiB uploads as two chunks on one thread, at 0.93x the plain call; in the
    /// staging sweep that form moved 9.0 / 10.5 GB/s at 384 / 512 KiB, the 1 MiB choice of two
    /// participants 10.9 / 12.0.)
    pub fn staging_for(
        &self,
        path: TransferPath,
        device: usize,
        bytes: usize,
    ) -> Option<StagingConfig> {
        let distance = |b: usize| size_distance(b, bytes);
        // A table built in code may hold a configuration `parse` would refuse: never used.
        let measured = || {
            self.staging
                .iter()
                .filter(|c| c.path == path && c.device == device && c.config.validate().is_ok())
        };
        let applies = |c: &&StagingChoice| {
            c.config.runs_as_one_block(bytes) || !c.config.runs_as_one_block(c.bytes)
        };
        let nearest = |a: &&StagingChoice, b: &&StagingChoice| {
            distance(a.bytes).total_cmp(&distance(b.bytes))
        };
        measured()
            .filter(applies)
            .min_by(nearest)
            .or_else(|| measured().min_by(nearest))
            .map(|c| c.config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_choices_are_per_path_device_and_nearest_size() {
        let mut table = CalibrationTable::default();
        let config = |chunk_bytes| StagingConfig {
            chunk_bytes,
            depth: 2,
            threads: 8,
            host_copy: crate::HostCopy::Cached,
            order: crate::ChunkOrder::Ordered,
        };
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        for (bytes, chunk) in [(4 << 20, 256 << 10), (256 << 20, 4 << 20)] {
            table.record_staging(StagingChoice {
                path: h2d,
                device: 0,
                bytes,
                config: config(chunk),
                gbps: 30.0,
            });
        }
        // Replacing keeps one choice per key (the table stays bounded over recalibrations).
        for _ in 0..1000 {
            table.record_staging(StagingChoice {
                path: h2d,
                device: 0,
                bytes: 4 << 20,
                config: config(512 << 10),
                gbps: 31.0,
            });
        }
        assert_eq!(table.staging.len(), 2);
        assert_eq!(
            table.staging_for(h2d, 0, 3 << 20).unwrap().chunk_bytes,
            512 << 10
        );
        assert_eq!(
            table.staging_for(h2d, 0, 1 << 30).unwrap().chunk_bytes,
            4 << 20
        );
        assert_eq!(table.staging_for(h2d, 1, 4 << 20), None);
        assert_eq!(
            table.staging_for(TransferPath::DEVICE_TO_PAGEABLE, 0, 4 << 20),
            None
        );
        let back = CalibrationTable::from_json(&table.to_json()).unwrap();
        assert_eq!(back, table);
    }

    #[rstest::rstest]
    #[case::held_by_the_block(200 << 10, 256 << 10, 1)]
    #[case::the_block_itself(256 << 10, 256 << 10, 1)]
    #[case::just_past_the_block(300 << 10, 256 << 10, 2)]
    #[case::tied_between_the_two(512 << 10, 256 << 10, 2)]
    #[case::nearer_the_pipeline(768 << 10, 256 << 10, 2)]
    fn a_one_block_choice_applies_only_where_its_block_holds_the_copy(
        #[case] bytes: usize,
        #[case] chunk: usize,
        #[case] threads: usize,
    ) {
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        let config = |threads| StagingConfig {
            chunk_bytes: 256 << 10,
            depth: 2,
            threads,
            host_copy: crate::HostCopy::Streaming,
            order: crate::ChunkOrder::Ordered,
        };
        let mut table = CalibrationTable::default();
        // As calibration records them: one 256 KiB block at 256 KiB, a pipeline of two
        // participants at 1 MiB.
        for (at, threads) in [(256 << 10, 1), (1 << 20, 2)] {
            table.record_staging(StagingChoice {
                path: h2d,
                device: 0,
                bytes: at,
                config: config(threads),
                gbps: 10.0,
            });
        }
        let chosen = table.staging_for(h2d, 0, bytes).unwrap();
        assert_eq!((chosen.chunk_bytes, chosen.threads), (chunk, threads));
        // With nothing else measured, the one-block choice is still the nearest there is.
        table.staging.retain(|c| c.bytes == 256 << 10);
        assert_eq!(table.staging_for(h2d, 0, bytes).unwrap().threads, 1);
    }
}
