//! [`CalibrationTable`]: measured bandwidth per (path, size class, method), the input of the
//! method choice, and what registering host memory costs ([`RegistrationCost`]); saved and
//! loaded as JSON; [`CalibrationTable::h100_defaults`] when nothing was measured.

mod defaults;
mod entry;
mod json;
mod machine;
mod registration;
mod staging_choice;
mod table;

pub use defaults::DEFAULT_MACHINE;
pub use entry::{CalibrationEntry, Measure};
pub use machine::MachineMismatch;
pub use registration::RegistrationCost;
pub use staging_choice::StagingChoice;
pub use table::CalibrationTable;

/// How far apart two transfer sizes are, on a log scale: the larger over the smaller (1 for
/// equal sizes). Cheap enough for every transfer's planning (no logarithm).
pub(crate) fn size_distance(a: usize, b: usize) -> f64 {
    let (a, b) = (a.max(1) as f64, b.max(1) as f64);
    if a > b { a / b } else { b / a }
}
