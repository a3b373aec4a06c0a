//! The pinned pool's cache against a model, with proptest: random gets (warmest block first, or
//! from the cold rotation), returns with fences,
//! fences passing or faulting, polls and trims. After every step: a block handed out is of the
//! class asked for and is neither held by someone else, nor waiting for a fence, nor freed; a
//! block freed is neither held nor waiting (a faulted one is never freed or reused); and the
//! statistics balance and equal the model's counts.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;

use cuweave_driver::DriverError;
use proptest::prelude::*;

use super::tests::fault;
use super::*;
use crate::proptest_config::config;

#[derive(Debug)]
struct Block {
    id: u32,
    capacity: usize,
}

impl Capacity for Block {
    fn capacity(&self) -> usize {
        self.capacity
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    Running,
    Done,
    Faulted,
}

#[derive(Debug, Clone)]
struct TestFence(Rc<Cell<Work>>);

impl Fence for TestFence {
    fn passed(&self) -> Result<bool, DriverError> {
        match self.0.get() {
            Work::Running => Ok(false),
            Work::Done => Ok(true),
            Work::Faulted => Err(fault()),
        }
    }

    fn wait(&self) -> Result<(), DriverError> {
        match self.0.get() {
            Work::Faulted => Err(fault()),
            _ => {
                self.0.set(Work::Done);
                Ok(())
            }
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Get { class: usize },
    GetCold { class: usize, keep: usize },
    Return { index: usize, fences: usize },
    Pass { index: usize },
    Fault { index: usize },
    Poll,
    Trim,
}

const CLASSES: [usize; 4] = [4 << 10, 8 << 10, 64 << 10, 1 << 20];

fn ops() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => prop::sample::select(CLASSES.to_vec()).prop_map(|class| Op::Get { class }),
        3 => (prop::sample::select(CLASSES.to_vec()), 0usize..4)
            .prop_map(|(class, keep)| Op::GetCold { class, keep }),
        5 => (any::<usize>(), 0usize..=2).prop_map(|(index, fences)| Op::Return { index, fences }),
        4 => any::<usize>().prop_map(|index| Op::Pass { index }),
        1 => any::<usize>().prop_map(|index| Op::Fault { index }),
        1 => Just(Op::Poll),
        1 => Just(Op::Trim),
    ]
}

/// The state of one fence's work, shared by the model and the fence.
type WorkState = Rc<Cell<Work>>;

#[derive(Debug, Default)]
struct Model {
    /// Blocks held by users: id -> capacity.
    held: BTreeMap<u32, usize>,
    /// Returned blocks with the fences of their last use.
    returned: BTreeMap<u32, (usize, Vec<WorkState>)>,
    freed: BTreeSet<u32>,
    pinned: usize,
    gets: u64,
    hits: u64,
    next_id: u32,
}

impl Model {
    /// Whether a returned block may be handed out or freed now.
    fn settled(&self, id: u32) -> bool {
        self.returned
            .get(&id)
            .is_some_and(|(_, fences)| fences.iter().all(|work| work.get() == Work::Done))
    }

    fn absorb(&mut self, released: Released<Block, TestFence>) {
        for block in released.blocks {
            assert!(!self.held.contains_key(&block.id), "freed a block in use");
            assert!(
                self.settled(block.id),
                "freed block {} before its fences passed",
                block.id
            );
            self.returned.remove(&block.id);
            assert!(self.freed.insert(block.id), "freed twice");
            self.pinned -= block.capacity;
        }
    }
}

fn run(ops: Vec<Op>, max_cached: usize) {
    let mut cache = BlockCache::<Block, TestFence>::new(max_cached);
    let mut model = Model::default();
    for op in ops {
        let mut released = Released::default();
        match op {
            Op::Get { class } | Op::GetCold { class, .. } => {
                model.gets += 1;
                let taken = match op {
                    Op::GetCold { keep, .. } => cache.take_cold(class, keep, &mut released),
                    _ => cache.take(class, &mut released),
                };
                match taken {
                    Some(block) => {
                        model.hits += 1;
                        assert_eq!(block.capacity, class);
                        assert!(
                            model.settled(block.id),
                            "block {} reused before its fences passed",
                            block.id
                        );
                        model.returned.remove(&block.id);
                        model.held.insert(block.id, class);
                    }
                    None => {
                        let id = model.next_id;
                        model.next_id += 1;
                        cache.add_pinned(class);
                        model.pinned += class;
                        model.held.insert(id, class);
                    }
                }
            }
            Op::Return { index, fences } => {
                if !model.held.is_empty() {
                    let id = *model.held.keys().nth(index % model.held.len()).unwrap();
                    let capacity = model.held.remove(&id).unwrap();
                    let works: Vec<Rc<Cell<Work>>> = (0..fences)
                        .map(|_| Rc::new(Cell::new(Work::Running)))
                        .collect();
                    model.returned.insert(id, (capacity, works.clone()));
                    let fences = works.into_iter().map(TestFence).collect();
                    cache.give_back(Block { id, capacity }, fences, &mut released);
                }
            }
            Op::Pass { index } | Op::Fault { index } => {
                let running: Vec<Rc<Cell<Work>>> = model
                    .returned
                    .values()
                    .flat_map(|(_, works)| works.iter().cloned())
                    .filter(|work| work.get() == Work::Running)
                    .collect();
                if !running.is_empty() {
                    let state = if matches!(op, Op::Pass { .. }) {
                        Work::Done
                    } else {
                        Work::Faulted
                    };
                    running[index % running.len()].set(state);
                }
            }
            Op::Poll => cache.poll(&mut released),
            Op::Trim => {
                cache.drain_ready(&mut released);
            }
        }
        model.absorb(released);
        let stats = cache.stats();
        let held_bytes: usize = model.held.values().sum();
        assert_eq!(stats.allocated_bytes, held_bytes);
        assert_eq!(stats.allocated_blocks, model.held.len());
        assert_eq!(stats.pinned_bytes, model.pinned);
        assert_eq!(
            stats.pinned_bytes,
            stats.allocated_bytes + stats.cached_bytes
        );
        assert!(stats.pending_bytes <= stats.cached_bytes);
        assert_eq!((stats.gets, stats.hits), (model.gets, model.hits));
        assert_eq!(stats.gets, stats.hits + stats.misses);
        let returned_bytes: usize = model.returned.values().map(|(capacity, _)| capacity).sum();
        assert_eq!(
            stats.cached_bytes, returned_bytes,
            "every returned, unfreed block is cached"
        );
    }
    // Forget the blocks users still hold (the model owns their ids, not the values).
    cache.shutdown();
}

proptest! {
    #![proptest_config(config(1500))]

    #[test]
    fn the_cache_matches_its_model(
        ops in prop::collection::vec(ops(), 1..64),
        max_cached_kib in prop::sample::select(vec![0usize, 8, 64, 1024, 4096]),
    ) {
        run(ops, max_cached_kib << 10);
    }
}
