//! unified (in progress).
