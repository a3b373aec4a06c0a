//! The caching engine against a model, with proptest: random sequences of allocations, frees,
//! frees of blocks recorded on other streams (with fake markers), marker completion, polling,
//! `empty_cache`, peak resets and upstream failures (out of memory under a cap, and other
//! errors), on four streams over 1, 2 or 32 shards (so streams share a shard, and with it the
//! small pool's slots and their cached lookup, or do not). After every step:
//!
//! - no two live allocations overlap, and no allocation overlaps a freed block whose recorded
//!   uses have not all completed (a block is never handed out while a recorded use is pending);
//! - every allocation is at least as large as asked for, and belongs to its stream;
//! - the statistics equal the model's: allocated and requested bytes (current, and peaks per
//!   shard summed), allocation and free counts, reserved bytes and segments (current and
//!   peak, equal to what the fake upstream holds), and active bytes between its bounds (exact
//!   once the cache is emptied);
//! - the pools' structural invariants hold (links, merging, free-list membership).
//!
//! A few thousand cases by default; `CUWEAVE_PROPTEST_CASES=N` runs more.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::caching::stream_uses::fake::Flag;
use crate::proptest_config::config;

const MIB: usize = 1 << 20;

/// A fake upstream: segments at increasing, never-overlapping addresses, a cap that makes it
/// run out of memory, and a switch that makes its next allocation fail with another error.
#[derive(Debug)]
struct Upstream {
    next: Cell<u64>,
    cap: Cell<usize>,
    broken: Cell<bool>,
    outstanding: RefCell<BTreeMap<u64, usize>>,
}

impl Upstream {
    fn new(cap: usize) -> Self {
        Self {
            next: Cell::new(0x7f00_0000_0000),
            cap: Cell::new(cap),
            broken: Cell::new(false),
            outstanding: RefCell::new(BTreeMap::new()),
        }
    }

    fn held(&self) -> usize {
        self.outstanding.borrow().values().sum()
    }
}

impl Release for Upstream {
    fn release_segments(&self, segments: &[Segment]) -> Result<()> {
        let mut outstanding = self.outstanding.borrow_mut();
        for segment in segments {
            assert_eq!(
                outstanding.remove(&segment.ptr),
                Some(segment.size),
                "released a segment the upstream never gave out"
            );
        }
        Ok(())
    }
}

impl super::Upstream for Upstream {
    fn allocate_segment(&self, bytes: usize) -> Result<u64> {
        if self.broken.replace(false) {
            return Err(MemoryError::ZeroLength {
                operation: "broken upstream",
            });
        }
        let held = self.held();
        if held.saturating_add(bytes) > self.cap.get() {
            return Err(MemoryError::OutOfMemory {
                requested: bytes,
                allocated: held,
                reserved: held,
                limit: Some(self.cap.get()),
            });
        }
        let ptr = self.next.get();
        self.next.set(ptr + bytes as u64 + 0x10_0000);
        self.outstanding.borrow_mut().insert(ptr, bytes);
        Ok(ptr)
    }
}

#[derive(Debug, Clone)]
enum Op {
    /// Allocate `bytes` on stream `stream`.
    Allocate { stream: usize, bytes: usize },
    /// Free the live allocation at `index` (modulo the live count) on its stream.
    Free { index: usize },
    /// Free the live allocation at `index`, recorded on `uses` other streams.
    FreeRecorded { index: usize, uses: usize },
    /// Complete the marker at `index` (modulo the incomplete count).
    Complete { index: usize },
    /// Poll pending blocks without blocking.
    Poll,
    /// `empty_cache`: wait for pending blocks, release free segments.
    EmptyCache,
    /// Make the upstream's next allocation fail with a non-memory error.
    BreakUpstream,
    /// Change the upstream's cap.
    SetCap { mib: usize },
    /// Reset the peaks.
    ResetPeak,
}

fn sizes() -> impl Strategy<Value = usize> {
    prop_oneof![
        3 => 1usize..=4096,
        3 => 1usize..=(MIB + 1),
        2 => prop::sample::select(vec![512, 4096, MIB, MIB + 1, 2 * MIB, 10 * MIB - 1, 10 * MIB, 12 * MIB]),
        1 => MIB..=(24 * MIB),
    ]
}

fn ops() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (1usize..=4, sizes()).prop_map(|(stream, bytes)| Op::Allocate { stream, bytes }),
        4 => any::<usize>().prop_map(|index| Op::Free { index }),
        3 => (any::<usize>(), 1usize..=2).prop_map(|(index, uses)| Op::FreeRecorded { index, uses }),
        3 => any::<usize>().prop_map(|index| Op::Complete { index }),
        1 => Just(Op::Poll),
        1 => Just(Op::EmptyCache),
        1 => Just(Op::BreakUpstream),
        1 => (8usize..=96).prop_map(|mib| Op::SetCap { mib }),
        1 => Just(Op::ResetPeak),
    ]
}

/// A live allocation as the model knows it.
#[derive(Debug, Clone)]
struct Live {
    grant: Grant,
    requested: usize,
}

/// A block freed while recorded on other streams, since the cache was last emptied.
#[derive(Debug)]
struct Guarded {
    ptr: u64,
    size: usize,
    markers: Vec<Flag>,
}

#[derive(Debug, Default)]
struct Model {
    live: Vec<Live>,
    guarded: Vec<Guarded>,
    allocations: u64,
    frees: u64,
    ooms: u64,
    /// Per shard: allocated bytes now and their peak since the last reset.
    allocated: BTreeMap<usize, (usize, usize)>,
    shards: usize,
    reserved_peak: usize,
    segments_peak: usize,
}

fn overlaps(a: (u64, usize), b: (u64, usize)) -> bool {
    a.0 < b.0 + b.1 as u64 && b.0 < a.0 + a.1 as u64
}

impl Model {
    fn check_grant(&self, grant: &Grant, stream: StreamKey, bytes: usize) {
        assert!(
            grant.size >= bytes,
            "a short allocation: {} < {bytes}",
            grant.size
        );
        assert_eq!(grant.stream, stream);
        let range = (grant.ptr, grant.size);
        for live in &self.live {
            assert!(
                !overlaps(range, (live.grant.ptr, live.grant.size)),
                "{grant:?} overlaps live {:?}",
                live.grant
            );
        }
        for guarded in &self.guarded {
            if guarded
                .markers
                .iter()
                .any(|flag| !flag.is_complete().unwrap())
            {
                assert!(
                    !overlaps(range, (guarded.ptr, guarded.size)),
                    "{grant:?} handed out while a recorded use of {guarded:?} is pending"
                );
            }
        }
    }

    fn allocated_add(&mut self, stream: StreamKey, bytes: usize) {
        let shard = stream.as_usize() & (self.shards - 1);
        let entry = self.allocated.entry(shard).or_default();
        entry.0 += bytes;
        entry.1 = entry.1.max(entry.0);
    }

    fn allocated_sub(&mut self, stream: StreamKey, bytes: usize) {
        self.allocated
            .get_mut(&(stream.as_usize() & (self.shards - 1)))
            .expect("allocated on this stream")
            .0 -= bytes;
    }

    fn take_live(&mut self, index: usize) -> Option<Live> {
        if self.live.is_empty() {
            return None;
        }
        let live = self.live.swap_remove(index % self.live.len());
        self.frees += 1;
        self.allocated_sub(live.grant.stream, live.grant.size);
        Some(live)
    }

    fn check_stats(&mut self, engine: &Engine<Flag>, upstream: &Upstream, emptied: bool) {
        engine.check_invariants();
        let stats = engine.stats();
        let live_bytes: usize = self.live.iter().map(|live| live.grant.size).sum();
        let requested: usize = self.live.iter().map(|live| live.requested).sum();
        let pending_bound: usize = self
            .guarded
            .iter()
            .filter(|guarded| {
                guarded
                    .markers
                    .iter()
                    .any(|flag| !flag.is_complete().unwrap())
            })
            .map(|guarded| guarded.size)
            .sum();
        let guarded_bytes: usize = self.guarded.iter().map(|guarded| guarded.size).sum();
        assert_eq!(stats.allocated_bytes.current, live_bytes);
        assert_eq!(stats.requested_bytes.current, requested);
        assert_eq!(stats.allocations, self.allocations);
        assert_eq!(stats.frees, self.frees);
        assert_eq!(stats.ooms, self.ooms);
        assert!(stats.oom_retries >= stats.ooms);
        let peaks: usize = self.allocated.values().map(|(_, peak)| peak).sum();
        assert_eq!(stats.allocated_bytes.peak, peaks, "per-shard peaks, summed");
        assert!(stats.active_bytes.current >= live_bytes + pending_bound);
        assert!(stats.active_bytes.current <= live_bytes + guarded_bytes);
        if emptied {
            assert_eq!(
                stats.active_bytes.current, live_bytes,
                "empty_cache waited for every use"
            );
            assert_eq!(engine.pending_blocks(), 0);
        }
        let held = upstream.held();
        let segments = upstream.outstanding.borrow().len();
        assert_eq!(stats.reserved_bytes.current, held);
        assert_eq!(stats.segments.current, segments);
        self.reserved_peak = self.reserved_peak.max(held);
        self.segments_peak = self.segments_peak.max(segments);
        assert_eq!(stats.reserved_bytes.peak, self.reserved_peak);
        assert_eq!(stats.segments.peak, self.segments_peak);
    }
}

fn run(ops: Vec<Op>, cap_mib: usize, shards: usize) {
    let engine = Engine::<Flag>::with_shards(shards);
    let upstream = Upstream::new(cap_mib * MIB);
    let mut model = Model {
        shards,
        ..Model::default()
    };
    for op in ops {
        let mut emptied = false;
        match op {
            Op::Allocate { stream, bytes } => {
                let key = StreamKey::from_raw(stream);
                let broken = upstream.broken.get();
                match engine.allocate(key, bytes, &upstream) {
                    Ok(grant) => {
                        model.check_grant(&grant, key, bytes);
                        model.allocations += 1;
                        model.allocated_add(key, grant.size);
                        model.live.push(Live {
                            grant,
                            requested: bytes,
                        });
                    }
                    Err(MemoryError::OutOfMemory { requested, .. }) => {
                        assert!(requested >= bytes);
                        model.ooms += 1;
                        // The retry waited for every pending block.
                        model.guarded.retain(|_| false);
                        emptied = true;
                    }
                    Err(MemoryError::ZeroLength { .. }) if broken => {}
                    Err(error) => panic!("unexpected error {error}"),
                }
            }
            Op::Free { index } => {
                if let Some(live) = model.take_live(index) {
                    let grant = live.grant;
                    engine.free(grant.stream, grant.id, grant.ptr).unwrap();
                }
            }
            Op::FreeRecorded { index, uses } => {
                if let Some(live) = model.take_live(index) {
                    let grant = live.grant;
                    // On one of three streams, or on no known stream; completed in any
                    // order by `Complete`, so the per-stream queues are often out of order.
                    let markers: Vec<Flag> = (0..uses)
                        .map(|use_| match (index + use_) % 4 {
                            3 => Flag::default(),
                            stream => Flag::on(stream as u64),
                        })
                        .collect();
                    engine
                        .free_after(grant.stream, grant.id, grant.ptr, markers.clone())
                        .unwrap();
                    model.guarded.push(Guarded {
                        ptr: grant.ptr,
                        size: grant.size,
                        markers,
                    });
                }
            }
            Op::Complete { index } => {
                let incomplete: Vec<&Flag> = model
                    .guarded
                    .iter()
                    .flat_map(|guarded| &guarded.markers)
                    .filter(|flag| !flag.is_complete().unwrap())
                    .collect();
                if !incomplete.is_empty() {
                    incomplete[index % incomplete.len()].complete();
                }
            }
            Op::Poll => engine.process_pending(),
            Op::EmptyCache => {
                engine.release_cached(&upstream).unwrap();
                model.guarded.clear();
                emptied = true;
            }
            Op::BreakUpstream => upstream.broken.set(true),
            Op::SetCap { mib } => upstream.cap.set(mib * MIB),
            Op::ResetPeak => {
                engine.reset_peak();
                for (current, peak) in model.allocated.values_mut() {
                    *peak = *current;
                }
                model.reserved_peak = upstream.held();
                model.segments_peak = upstream.outstanding.borrow().len();
            }
        }
        // Guarded blocks whose markers all completed may be reused from now on (the engine may
        // or may not have polled them yet); they stay listed until the cache is emptied, as the
        // upper bound of active bytes.
        model.check_stats(&engine, &upstream, emptied);
    }
    // Free everything, empty the cache: nothing is left reserved.
    for live in std::mem::take(&mut model.live) {
        model.frees += 1;
        model.allocated_sub(live.grant.stream, live.grant.size);
        engine
            .free(live.grant.stream, live.grant.id, live.grant.ptr)
            .unwrap();
    }
    engine.release_cached(&upstream).unwrap();
    model.guarded.clear();
    model.check_stats(&engine, &upstream, true);
    assert_eq!(upstream.held(), 0, "every segment went back");
}

proptest! {
    #![proptest_config(config(2000))]

    #[test]
    fn the_engine_matches_its_model(
        ops in prop::collection::vec(ops(), 1..48),
        cap_mib in 8usize..=128,
        shards in prop::sample::select(vec![1usize, 2, SHARDS]),
    ) {
        run(ops, cap_mib, shards);
    }

    #[test]
    fn any_request_size_is_a_grant_of_at_least_that_size_or_a_typed_error(
        bytes in prop_oneof![
            Just(0usize),
            (usize::MAX - 4096)..=usize::MAX,
            (isize::MAX as usize - 4096)..=(isize::MAX as usize + 4096),
            1usize..=(64 * MIB),
        ],
    ) {
        let engine = Engine::<Flag>::default();
        let upstream = Upstream::new(256 * MIB);
        match engine.allocate(StreamKey::from_raw(1), bytes, &upstream) {
            Ok(grant) => {
                prop_assert!(bytes > 0 && grant.size >= bytes);
                engine.free(grant.stream, grant.id, grant.ptr).unwrap();
            }
            Err(MemoryError::ZeroLength { .. }) => prop_assert_eq!(bytes, 0),
            Err(MemoryError::OutOfMemory { requested, .. }) => prop_assert!(requested >= bytes),
            Err(error) => prop_assert!(false, "unexpected error {error}"),
        }
        engine.check_invariants();
        prop_assert_eq!(engine.stats().allocated_bytes.current, 0);
    }
}
