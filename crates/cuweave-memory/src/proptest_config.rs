//! How many cases the property tests run: a few thousand by default (seconds on two cores),
//! more with `CUWEAVE_PROPTEST_CASES=N` for a longer run.

use proptest::test_runner::Config;

/// Name of the environment variable that sets the number of cases of every property test.
pub(crate) const CASES_VAR: &str = "CUWEAVE_PROPTEST_CASES";

/// A proptest configuration with `default` cases, or `CUWEAVE_PROPTEST_CASES` when set.
pub(crate) fn config(default: u32) -> Config {
    let cases = std::env::var(CASES_VAR)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default);
    Config {
        cases,
        // Failing cases are shrunk and printed; no regression files are written into the tree.
        failure_persistence: None,
        ..Config::default()
    }
}
