//! A [`CalibrationTable`] as JSON, saved and loaded, with every figure and staging
//! configuration checked on the way in.

use std::path::Path;

use super::CalibrationTable;
use crate::error::{Result, TransferError};

impl CalibrationTable {
    /// The table as pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a calibration table always serialises")
    }

    /// A table from JSON (as [`to_json`](Self::to_json) writes it).
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] (path `<json>`) when the text is not a table, names a
    /// staging configuration that cannot run ([`StagingConfig::validate`]), or holds a negative
    /// bandwidth or registration cost.
    ///
    /// [`StagingConfig::validate`]: crate::StagingConfig::validate
    pub fn from_json(json: &str) -> Result<Self> {
        Self::parse(json, "<json>")
    }

    /// The table in `text`, read from `path`, with every staging configuration checked
    /// ([`StagingConfig::validate`]): a file can name one that would overflow or pin without
    /// bound.
    ///
    /// [`StagingConfig::validate`]: crate::StagingConfig::validate
    fn parse(text: &str, path: &str) -> Result<Self> {
        let file_error = |message: String| TransferError::CalibrationFile {
            path: path.to_owned(),
            message,
        };
        let table: Self = serde_json::from_str(text).map_err(|e| file_error(e.to_string()))?;
        for choice in &table.staging {
            choice
                .config
                .validate()
                .map_err(|e| file_error(e.to_string()))?;
        }
        // A planner that compares figures must never read a negative one as a real speed, nor a
        // negative registration cost as a saving.
        let figures = table
            .entries
            .iter()
            .map(|e| ("a bandwidth", e.gbps))
            .chain(
                table
                    .staging
                    .iter()
                    .map(|c| ("a staging bandwidth", c.gbps)),
            )
            .chain(table.registration.iter().flat_map(|r| {
                [
                    ("the fixed registration cost", r.fixed_ms),
                    ("the registration cost per MiB", r.ms_per_mib),
                ]
            }));
        for (what, figure) in figures {
            if !(figure.is_finite() && figure >= 0.0) {
                return Err(file_error(format!(
                    "{what} of {figure} (figures are finite and not negative)"
                )));
            }
        }
        Ok(table)
    }

    /// Writes the table to `path` as JSON.
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] when the file cannot be written.
    pub fn save(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_json()).map_err(|error| TransferError::CalibrationFile {
            path: path.display().to_string(),
            message: error.to_string(),
        })
    }

    /// Reads a table written by [`save`](Self::save).
    ///
    /// # Errors
    /// [`TransferError::CalibrationFile`] when the file cannot be read or is not a table.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|error| TransferError::CalibrationFile {
                path: path.display().to_string(),
                message: error.to_string(),
            })?;
        Self::parse(&text, &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::calibration::{RegistrationCost, StagingChoice};
    use crate::location::{SizeClass, TransferPath};
    use crate::method::TransferMethod;
    use crate::staging::StagingConfig;

    #[test]
    fn tables_without_a_registration_cost_still_load_and_round_trip_with_one() {
        // A file written before registration was measured.
        let old = r#"{ "device": "NVIDIA H100 80GB HBM3",
            "entries": [ { "path": { "src": "pageable", "dst": "device", "cross_device": false },
                           "size_class": "large", "method": "host_staged", "gbps": 29.9 } ] }"#;
        let table = CalibrationTable::from_json(old).unwrap();
        assert_eq!(table.registration, None);
        assert_eq!(table.entries.len(), 1);
        assert!(!table.to_json().contains("registration"));
        let mut table = table;
        table.registration = Some(RegistrationCost {
            fixed_ms: 0.25,
            ms_per_mib: 0.125,
        });
        table.record(
            TransferPath::REGISTERED_TO_DEVICE,
            SizeClass::Large,
            TransferMethod::DirectCopy,
            53.1,
        );
        let json = table.to_json();
        assert!(
            json.contains("\"registration\"") && json.contains("\"registered\""),
            "{json}"
        );
        assert_eq!(CalibrationTable::from_json(&json).unwrap(), table);
        assert_eq!(
            CalibrationTable::h100_defaults().registration,
            Some(RegistrationCost::H100_DEFAULT)
        );
    }

    /// A hand-written file with only a registration cost (no `entries`) loads: the planner then
    /// falls back to its labelled defaults for every figure.
    #[test]
    fn a_file_without_entries_loads_with_none() {
        let only_registration = r#"{ "device": null,
            "registration": { "fixed_ms": 0.25, "ms_per_mib": 0.125 } }"#;
        let table = CalibrationTable::from_json(only_registration).unwrap();
        assert!(table.entries.is_empty());
        assert_eq!(
            table.registration,
            Some(RegistrationCost {
                fixed_ms: 0.25,
                ms_per_mib: 0.125
            })
        );
        assert_eq!(
            CalibrationTable::from_json(&table.to_json()).unwrap(),
            table
        );
    }

    #[test]
    fn negative_figures_in_a_file_are_refused_by_name() {
        let table = CalibrationTable::h100_defaults();
        let json = table.to_json();
        assert_eq!(CalibrationTable::from_json(&json).unwrap(), table);
        let mut bad = table.clone();
        bad.entries[0].gbps = -3.5;
        let error = CalibrationTable::from_json(&bad.to_json()).unwrap_err();
        assert!(error.to_string().contains("a bandwidth of -3.5"), "{error}");
        let mut bad = table.clone();
        bad.registration = Some(RegistrationCost {
            fixed_ms: 0.2,
            ms_per_mib: -0.01,
        });
        let error = CalibrationTable::from_json(&bad.to_json()).unwrap_err();
        assert!(error.to_string().contains("per MiB of -0.01"), "{error}");
        // Zero is a figure a failed measurement can round to: it loads, and never wins.
        let mut zero = table;
        zero.entries[0].gbps = 0.0;
        assert_eq!(CalibrationTable::from_json(&zero.to_json()).unwrap(), zero);
    }

    #[rstest::rstest]
    #[case::depth_that_overflows(4 << 20, usize::MAX, 8, "depth")]
    #[case::no_depth(4 << 20, 0, 8, "depth")]
    #[case::empty_chunks(0, 2, 8, "chunk_bytes")]
    #[case::byte_chunks(1, 2, 8, "chunk_bytes")]
    #[case::chunks_past_1_gib((1 << 30) + 1, 2, 8, "chunk_bytes")]
    #[case::no_threads(4 << 20, 2, 0, "threads")]
    #[case::more_threads_than_workers(4 << 20, 2, crate::MAX_WORKERS + 2, "threads")]
    fn a_staging_configuration_that_cannot_run_is_refused_from_files_and_never_used(
        #[case] chunk_bytes: usize,
        #[case] depth: usize,
        #[case] threads: usize,
        #[case] bound: &str,
    ) {
        let h2d = TransferPath::PAGEABLE_TO_DEVICE;
        let bad = StagingConfig {
            chunk_bytes,
            depth,
            threads,
            host_copy: crate::HostCopy::Streaming,
            order: crate::ChunkOrder::Ordered,
        };
        assert!(matches!(
            bad.validate(),
            Err(TransferError::InvalidStaging { config, reason })
                if config == bad && reason.contains(bound)
        ));
        let mut table = CalibrationTable::default();
        table.record_staging(StagingChoice {
            path: h2d,
            device: 0,
            bytes: 64 << 20,
            config: bad,
            gbps: 40.0,
        });
        let error = CalibrationTable::from_json(&table.to_json()).unwrap_err();
        assert!(
            matches!(&error, TransferError::CalibrationFile { path, message }
                if path == "<json>" && message.contains(bound)),
            "{error}"
        );
        // Built in code instead: the planner passes over it to the defaults.
        assert_eq!(table.staging_for(h2d, 0, 64 << 20), None);
        // Saturates instead of overflowing (a debug build would panic).
        assert!(bad.staging_bytes() >= bad.chunk_bytes);
    }
}
