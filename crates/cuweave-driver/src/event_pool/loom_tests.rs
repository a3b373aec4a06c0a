//! Loom models of the per-thread slot protocol ([`OwnerSlot`]): every interleaving of an owner
//! caching and reusing its item while another thread steals is explored.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p cuweave-driver --release --lib loom`.

use loom::sync::Arc;
use loom::thread;

use super::owner_slot::OwnerSlot;

#[test]
fn loom_an_item_cached_by_its_owner_is_taken_by_exactly_one_thread() {
    loom::model(|| {
        let slot = Arc::new(OwnerSlot::new());
        let thief = {
            let slot = Arc::clone(&slot);
            thread::spawn(move || slot.take())
        };
        // The owner releases item 7 into its slot, then wants an item back.
        assert!(slot.put(7));
        let owner_got = slot.take();
        let thief_got = thief.join().unwrap();
        let taken: Vec<u32> = owner_got.into_iter().chain(thief_got).collect();
        assert_eq!(taken, [7], "item 7 lost or handed out twice");
        assert!(!slot.is_full());
    });
}

#[test]
fn loom_the_owners_put_never_overwrites_an_item_while_thieves_take() {
    loom::model(|| {
        let slot = Arc::new(OwnerSlot::new());
        let thieves: Vec<_> = (0..2)
            .map(|_| {
                let slot = Arc::clone(&slot);
                thread::spawn(move || slot.take())
            })
            .collect();
        // Two releases: the second finds the slot full (then it goes to the shared list) or
        // emptied by a thief (then it is cached).
        let first = slot.put(1);
        let second_cached = slot.put(2);
        assert!(first);
        let mut seen: Vec<u32> = thieves
            .into_iter()
            .filter_map(|thief| thief.join().unwrap())
            .collect();
        seen.extend(slot.take());
        if !second_cached {
            seen.push(2); // what the caller would have pushed to the shared list
        }
        seen.sort_unstable();
        assert_eq!(seen, [1, 2], "an item was lost or duplicated");
    });
}
