//! [`InOrder`]: work items handed on strictly in order, each once, by whichever thread finds the
//! next ones ready. CUDA-free, so its protocol is model-checked with `loom` (`--cfg transfer_loom`).

use crate::error::Result;
#[cfg(all(test, transfer_loom))]
use crate::sync::AtomicBool;
use crate::sync::{AtomicUsize, Ordering};

/// Work items (chunks) handed on strictly in order, each once, by whichever thread finds the
/// next ones ready, with no thread ever waiting for another.
///
/// Every call of [`drain`](Self::drain) (one per item made ready) adds a signal; the call that
/// finds none pending becomes the one handing on, and hands on every ready item from the next
/// one; before it leaves it takes back the signals it has seen, and if more arrived meanwhile,
/// it looks again. So an item made ready while another thread hands on is never left behind,
/// and the protocol needs nothing stronger than acquire/release on one counter (no
/// store-then-load ordering across two locations, which `loom` cannot check). After a failure
/// the signals are never taken back: nothing more is handed on.
#[derive(Default)]
pub(crate) struct InOrder {
    /// Signals not yet taken back by the thread handing on (zero: nobody is).
    signals: AtomicUsize,
    /// The next item to hand on; only the thread handing on touches it, and the signals' counter
    /// passes it from one such thread to the next.
    next: AtomicUsize,
}

impl InOrder {
    /// Hands on (`hand(k)`) every item from the next one while `ready(k)`, unless another thread
    /// is at it (it will see this call's item). Call it once after making each item ready.
    pub(crate) fn drain(
        &self,
        ready: impl Fn(usize) -> bool,
        mut hand: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        if self.signals.fetch_add(1, Ordering::AcqRel) != 0 {
            return Ok(());
        }
        let mut seen = 1;
        loop {
            let mut k = self.next.load(Ordering::Relaxed);
            while ready(k) {
                if let Err(error) = hand(k) {
                    // The signals stay: nobody hands on after a failure.
                    self.next.store(k, Ordering::Relaxed);
                    return Err(error);
                }
                k += 1;
            }
            self.next.store(k, Ordering::Relaxed);
            let before = self.signals.fetch_sub(seen, Ordering::AcqRel);
            if before == seen {
                return Ok(());
            }
            // Items were made ready while this thread handed on: look again for them.
            seen = before - seen;
        }
    }
}

#[cfg(all(test, not(transfer_loom)))]
mod tests {
    use parking_lot::Mutex;

    use super::*;

    #[test]
    fn items_made_ready_in_any_order_by_many_threads_are_handed_on_once_in_order() {
        for round in 0..200 {
            let items = 64;
            let ready: Vec<std::sync::atomic::AtomicBool> = (0..items)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect();
            let handed = Mutex::new(Vec::new());
            let in_order = InOrder::default();
            let claims = AtomicUsize::new(0);
            std::thread::scope(|scope| {
                for t in 0..4 {
                    let (ready, handed, in_order, claims) = (&ready, &handed, &in_order, &claims);
                    scope.spawn(move || {
                        loop {
                            let i = claims.fetch_add(1, Ordering::Relaxed);
                            if i >= items {
                                break;
                            }
                            // Items finish out of order: every fourth one late.
                            if (i + t + round) % 4 == 0 {
                                std::thread::yield_now();
                            }
                            ready[i].store(true, Ordering::SeqCst);
                            in_order
                                .drain(
                                    |k| k < items && ready[k].load(Ordering::SeqCst),
                                    |k| {
                                        handed.lock().push(k);
                                        Ok(())
                                    },
                                )
                                .unwrap();
                        }
                    });
                }
            });
            assert_eq!(
                *handed.lock(),
                (0..items).collect::<Vec<_>>(),
                "round {round}"
            );
        }
    }

    #[test]
    fn after_a_failure_nothing_more_is_handed_on() {
        let in_order = InOrder::default();
        let handed = Mutex::new(Vec::new());
        let hand = |k: usize| {
            if k == 2 {
                return Err(crate::TransferError::WorkerPanicked);
            }
            handed.lock().push(k);
            Ok(())
        };
        assert!(in_order.drain(|k| k < 5, hand).is_err());
        assert!(in_order.drain(|k| k < 5, hand).is_ok());
        assert_eq!(*handed.lock(), [0, 1]);
    }
}

#[cfg(all(test, transfer_loom))]
mod loom_models {
    use super::*;

    type State = (InOrder, [AtomicBool; 3], AtomicUsize);

    /// Marks `item` ready and hands on what is ready, checking that each item is handed on
    /// once, in order.
    fn make_ready(state: &State, item: usize) {
        let (in_order, ready, handed) = state;
        ready[item].store(true, Ordering::Release);
        in_order
            .drain(
                |k| k < 3 && ready[k].load(Ordering::Acquire),
                |k| {
                    assert_eq!(handed.fetch_add(1, Ordering::Relaxed), k);
                    Ok(())
                },
            )
            .unwrap();
    }

    /// Items 0..3 made ready by spawned threads (one each, `spawned`) and by the model's own
    /// thread (`here`, in that order): in every interleaving all three are handed on.
    fn check(spawned: &'static [usize], here: &'static [usize]) {
        loom::model(move || {
            let state = loom::sync::Arc::new((
                InOrder::default(),
                [
                    AtomicBool::new(false),
                    AtomicBool::new(false),
                    AtomicBool::new(false),
                ],
                AtomicUsize::new(0),
            ));
            let others: Vec<_> = spawned
                .iter()
                .map(|&item| {
                    let state = loom::sync::Arc::clone(&state);
                    loom::thread::spawn(move || make_ready(&state, item))
                })
                .collect();
            for &item in here {
                make_ready(&state, item);
            }
            for other in others {
                other.join().unwrap();
            }
            assert_eq!(state.2.load(Ordering::Relaxed), 3);
        });
    }

    /// Two threads, the second's item between the first's two.
    #[test]
    fn loom_every_item_is_handed_on_once_in_order() {
        check(&[1], &[0, 2]);
    }

    /// Three threads, one item each, made ready in any order.
    #[test]
    fn loom_three_threads_one_item_each() {
        check(&[2, 0], &[1]);
    }
}
