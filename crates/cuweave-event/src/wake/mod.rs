//! The lock-free core of async waiting, free of CUDA so it can be model-checked.
//!
//! - [`WaitCell`]: one wait's outcome, decided once by compare-and-swap (completion, failure,
//!   timeout or cancellation), and the waker of whoever awaits it.
//! - [`Inbox`]: how new waits reach the reactor thread, which parks when it has nothing to
//!   watch and is unparked without a lost wake-up.
//!
//! The reactor ([`crate::waiter`]) glues these to the GPU: it watches completion words and
//! events, and decides cells. Both types compile against `loom`'s primitives under
//! `--cfg loom`; the model-checking tests are in this module's `loom_tests` (run with
//! `RUSTFLAGS="--cfg loom" cargo test -p cuweave-event --release loom`), and plain unit tests of
//! the same code run with `cargo test`.

mod cell;
mod inbox;
#[cfg(all(test, loom))]
mod loom_tests;
#[cfg(all(test, not(loom)))]
mod tests;

pub use cell::{Outcome, WaitCell};
pub use inbox::Inbox;
