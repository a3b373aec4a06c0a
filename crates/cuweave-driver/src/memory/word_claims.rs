//! [`WordClaims`]: which words of a [`MappedWords`](super::MappedWords) page one
//! [`StreamMarks`](super::StreamMarks) holds, and the highest value ever queued into each.
//!
//! Marks prove how far their stream has got, and callers hand host buffers back on that proof,
//! so a claimed word must not be written by anyone but its marks' stream, and marks that claim
//! a word must start above every value a write queued before can still put there. The protocol:
//!
//! - a host store moves its word `FREE -> STORING -> FREE` and is refused on a claimed word; a
//!   claim moves it `FREE -> CLAIMED` (waiting out a store under way), so a store never lands
//!   after a claim read the word;
//! - a queued write checks the claim, raises the word's high-water mark, then checks again; a
//!   claim reads the high-water mark after it took the word. Both reads after the other side's
//!   write are read-modify-writes (acquire-release), not loads: if the claim's read of the mark
//!   comes before the write's raise in the mark's modification order, the raise reads from it,
//!   so the claim happens before the write's second check, which then sees it. So a write that
//!   was queued either raised the mark before the claim read it, or saw the claim and was
//!   refused. (Plain sequentially consistent loads would also do, but loom models them only as
//!   acquire loads and could not check it.)
//!
//! It holds no CUDA: the loom models in `loom_tests` check both rules under every interleaving.

// loom's atomics only in the driver's own test build under `--cfg loom`, as `owner_slot` does.
#[cfg(all(loom, test))]
use loom::sync::atomic::{AtomicU8, AtomicU64, Ordering};
#[cfg(not(all(loom, test)))]
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

/// Anyone may write the word.
const FREE: u8 = 0;
/// A host store is writing it (claims wait for it to finish).
const STORING: u8 = 1;
/// Marks hold it: only their stream writes it.
const CLAIMED: u8 = 2;

/// Claims and high-water marks of `len` words (indices are checked by the caller).
#[derive(Debug)]
pub(crate) struct WordClaims {
    owners: Box<[AtomicU8]>,
    queued_max: Box<[AtomicU64]>,
}

impl WordClaims {
    pub(crate) fn new(len: usize) -> Self {
        Self {
            owners: (0..len).map(|_| AtomicU8::new(FREE)).collect(),
            queued_max: (0..len).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Runs `store` (a host write of word `index`) unless the word is claimed; whether it ran.
    pub(crate) fn store(&self, index: usize, store: impl FnOnce()) -> bool {
        let owner = &self.owners[index];
        loop {
            match owner.compare_exchange_weak(FREE, STORING, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(CLAIMED) => return false,
                Err(_) => spin(),
            }
        }
        store();
        owner.store(FREE, Ordering::SeqCst);
        true
    }

    /// Claims word `index` and returns the highest value it may hold now or later from a write
    /// queued before: the larger of `current()` (its value, read after the claim) and its
    /// high-water mark. `None` when other marks hold it.
    pub(crate) fn claim(&self, index: usize, current: impl FnOnce() -> u64) -> Option<u64> {
        let owner = &self.owners[index];
        loop {
            match owner.compare_exchange_weak(FREE, CLAIMED, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(_) => break,
                Err(CLAIMED) => return None,
                Err(_) => spin(),
            }
        }
        // A read-modify-write, not a load: see the module docs.
        let queued = self.queued_max[index].fetch_max(0, Ordering::AcqRel);
        Some(queued.max(current()))
    }

    /// Gives back a word [`claim`](Self::claim) took.
    pub(crate) fn release(&self, index: usize) {
        self.owners[index].store(FREE, Ordering::SeqCst);
    }

    /// Called before a write of `value` into word `index` is queued: whether it may be (`true`
    /// for the claiming marks' own writes, `by_claimant`; `false` for anyone else's while the
    /// word is claimed). A refused write leaves the high-water mark alone unless it raced a
    /// claim.
    pub(crate) fn before_queue(&self, index: usize, value: u64, by_claimant: bool) -> bool {
        let owner = &self.owners[index];
        if !by_claimant && owner.load(Ordering::SeqCst) == CLAIMED {
            return false;
        }
        self.queued_max[index].fetch_max(value, Ordering::AcqRel);
        // A read-modify-write, not a load: see the module docs.
        by_claimant || owner.fetch_add(0, Ordering::AcqRel) != CLAIMED
    }
}

#[cfg(all(loom, test))]
fn spin() {
    loom::thread::yield_now();
}

#[cfg(not(all(loom, test)))]
fn spin() {
    std::hint::spin_loop();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claimed_word_refuses_other_writers_and_its_next_claim_starts_above_them() {
        let claims = WordClaims::new(2);
        assert!(claims.before_queue(0, 5, false));
        assert_eq!(claims.claim(0, || 3), Some(5), "above the queued 5");
        assert_eq!(claims.claim(0, || 0), None, "one claimant at a time");
        assert!(!claims.before_queue(0, u64::MAX, false));
        assert!(!claims.store(0, || panic!("a store into a claimed word ran")));
        assert!(claims.before_queue(0, 9, true));
        claims.release(0);
        assert_eq!(
            claims.claim(0, || 0),
            Some(9),
            "a refused write raised nothing"
        );
        let mut stored = false;
        assert!(claims.store(1, || stored = true));
        assert!(stored);
    }
}

#[cfg(all(loom, test))]
mod loom_tests {
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64 as Word;
    use loom::thread;

    use super::*;

    /// A write another thread queues while marks claim the word is either refused or below
    /// where the marks start.
    #[test]
    fn loom_a_queued_write_is_refused_or_below_the_claimants_first_mark() {
        loom::model(|| {
            let claims = Arc::new(WordClaims::new(1));
            let writer = {
                let claims = Arc::clone(&claims);
                thread::spawn(move || claims.before_queue(0, 7, false))
            };
            let floor = claims.claim(0, || 0).expect("the only claim");
            let queued = writer.join().unwrap();
            assert!(
                !queued || floor >= 7,
                "write of 7 queued, marks start at {floor}"
            );
        });
    }

    /// A host store racing a claim either lands before the claim reads the word, or is refused.
    #[test]
    fn loom_a_host_store_is_refused_or_seen_by_the_claim() {
        loom::model(|| {
            let claims = Arc::new(WordClaims::new(1));
            let word = Arc::new(Word::new(0));
            let storer = {
                let (claims, word) = (Arc::clone(&claims), Arc::clone(&word));
                thread::spawn(move || claims.store(0, || word.store(u64::MAX, Ordering::SeqCst)))
            };
            let floor = claims
                .claim(0, || word.load(Ordering::SeqCst))
                .expect("the only claim");
            let stored = storer.join().unwrap();
            assert!(
                !stored || floor == u64::MAX,
                "a store slipped past the claim"
            );
            assert_eq!(
                word.load(Ordering::SeqCst),
                if stored { u64::MAX } else { 0 }
            );
        });
    }
}
