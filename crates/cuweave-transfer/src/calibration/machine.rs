//! Whether a table was measured on this machine ([`MachineMismatch`]).

use super::CalibrationTable;

/// A calibration table whose devices are not this machine's (see
/// [`TransferManager::set_calibration`](crate::TransferManager::set_calibration)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineMismatch {
    /// The devices the table was measured on (empty: not recorded).
    pub table: Vec<String>,
    /// This machine's devices.
    pub machine: Vec<String>,
}

impl MachineMismatch {
    /// The table's machine, as plans name it.
    pub fn measured_on(&self) -> String {
        if self.table.is_empty() {
            "an unrecorded machine".to_owned()
        } else {
            self.table.join(" + ")
        }
    }
}

impl std::fmt::Display for MachineMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "calibration measured on {}, this machine has {}; TransferManager::recalibrate() \
             measures this machine",
            self.measured_on(),
            if self.machine.is_empty() {
                "no devices".to_owned()
            } else {
                self.machine.join(" + ")
            }
        )
    }
}

impl CalibrationTable {
    /// `None` when the table was measured on a machine with exactly the devices `machine`
    /// (names by ordinal), else what differs. Tables without a device list compare their
    /// `device` label with device 0.
    pub fn check_machine(&self, machine: &[String]) -> Option<MachineMismatch> {
        let table = if self.devices.is_empty() {
            self.device.iter().cloned().collect::<Vec<_>>()
        } else {
            self.devices.clone()
        };
        let same = if self.devices.is_empty() {
            table.len() == 1 && machine.first() == table.first()
        } else {
            table == machine
        };
        (!same).then(|| MachineMismatch {
            table,
            machine: machine.to_vec(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_from_other_machines_are_found_out() {
        let here = vec!["NVIDIA H100 80GB HBM3".to_owned()];
        let defaults = CalibrationTable::h100_defaults();
        assert_eq!(defaults.check_machine(&here), None);
        let two = vec![here[0].clone(), here[0].clone()];
        let mismatch = defaults.check_machine(&two).unwrap();
        assert!(mismatch.to_string().contains("recalibrate"), "{mismatch}");
        // An old file with only a device label, and one with nothing at all.
        let old = CalibrationTable {
            device: Some("NVIDIA A100-SXM4-40GB".to_owned()),
            ..CalibrationTable::default()
        };
        assert_eq!(
            old.check_machine(&here).unwrap().measured_on(),
            "NVIDIA A100-SXM4-40GB"
        );
        assert_eq!(
            CalibrationTable::default()
                .check_machine(&here)
                .unwrap()
                .measured_on(),
            "an unrecorded machine"
        );
    }
}
