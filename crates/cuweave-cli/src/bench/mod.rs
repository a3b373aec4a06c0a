//! `cuweave bench`: bandwidth and latency of every copy direction on this machine, the raw driver
//! calls beside cuweave's methods, measured the way nvbandwidth does (a sweep of sizes, median
//! of repeated copies, host-observed completion).

pub mod measure;
pub mod plot;
pub mod report;

pub use measure::BenchError;
pub use report::parse_size;

/// The sizes swept when `--sizes` is not given: 4 KiB to 1 GiB.
pub const DEFAULT_SIZES: [usize; 8] = [
    4 << 10,
    64 << 10,
    1 << 20,
    4 << 20,
    16 << 20,
    64 << 20,
    256 << 20,
    1 << 30,
];
