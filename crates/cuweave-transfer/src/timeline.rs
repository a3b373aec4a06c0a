//! A diagnostic timeline of the staging pipeline (the `timeline` feature): instants at which a
//! transfer's steps happened, for comparing a pipeline with the probes in `docs/probes`.

use std::time::Instant;

use parking_lot::Mutex;

/// The most steps kept between two [`take`]s: later ones are dropped, so a program that never
/// takes them holds a bounded amount.
pub const MOST: usize = 1 << 20;

static EVENTS: Mutex<Vec<(Instant, &'static str, usize, usize)>> = Mutex::new(Vec::new());

/// Records step `what` of chunk `k` by participant `w` now (dropped past [`MOST`]).
pub fn mark(what: &'static str, k: usize, w: usize) {
    let at = Instant::now();
    let mut events = EVENTS.lock();
    if events.len() < MOST {
        events.push((at, what, k, w));
    }
}

/// Takes every step recorded so far.
pub fn take() -> Vec<(Instant, &'static str, usize, usize)> {
    std::mem::take(&mut *EVENTS.lock())
}
