//! The `CUWEAVE_STAGING_*` environment switches that turn parts of the pipeline off, for
//! sweeps and measurements; each read once.

use crate::workers;

pub(super) fn no_taper() -> bool {
    static NO_TAPER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&NO_TAPER, "CUWEAVE_STAGING_NO_TAPER")
}

pub(super) fn no_ramp() -> bool {
    static NO_RAMP: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&NO_RAMP, "CUWEAVE_STAGING_NO_RAMP")
}

pub(super) fn unordered_downloads() -> bool {
    static UNORDERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&UNORDERED, "CUWEAVE_STAGING_UNORDERED_DOWNLOADS")
}

pub(super) fn unordered_uploads() -> bool {
    static UNORDERED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&UNORDERED, "CUWEAVE_STAGING_UNORDERED_UPLOADS")
}

pub(super) fn one_upload_stream() -> bool {
    static ONE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&ONE, "CUWEAVE_STAGING_ONE_STREAM")
}

pub(super) fn plain_copy() -> bool {
    static PLAIN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    workers::env_switch(&PLAIN, "CUWEAVE_STAGING_PLAIN_COPY")
}
