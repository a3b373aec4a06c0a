//! What a [`GraphExec`](super::GraphExec) keeps alive across updates, and when an old
//! generation of it may go.
//!
//! Each successful `update` makes the new graph's keep-alives the *current* generation. The
//! previous one is still needed by the launches made before the update (they run with the old
//! parameters, so with the old buffers and pools), but by nothing after them. CUDA orders each
//! launch of an executable behind every earlier launch of it (`cuGraphLaunch`: "each launch is
//! ordered behind both any previous work in hStream and any previous launches of
//! hGraphExec"), so one fence recorded behind the first launch after an update completes only
//! once every launch before the update has: then the generations retired by that update may be
//! dropped. That costs one event record per update (on the first launch after it), nothing on
//! the other launches.
//!
//! The rule, [`Retirement`], holds no CUDA: the fence is a type parameter, so the bookkeeping is
//! tested on its own over many update loops.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

use super::handle::KeepAlive;

/// Something that says whether the work queued before it has finished.
pub(super) trait Fence {
    /// Whether the work before the fence has finished; `false` when it cannot tell now.
    fn is_complete(&self) -> bool;
}

impl Fence for crate::event_pool::OwnedPooledEvent {
    fn is_complete(&self) -> bool {
        fence_query_complete(self.query())
    }
}

impl Fence for crate::event::Event {
    fn is_complete(&self) -> bool {
        fence_query_complete(self.query())
    }
}

/// Whether a fence's query lets what waits for it go. Refused while a capture forbids the
/// query: not yet, asked again later. Any other failure never turns into completion (a dead
/// context, whose device runs nothing more; an event a launch recorded into a capture begun
/// outside cuweave, which the driver answers with an error once that capture has ended):
/// nothing is left to wait for, and keeping the values would hold them for ever.
fn fence_query_complete(answer: crate::error::Result<bool>) -> bool {
    match answer {
        Ok(done) => done,
        Err(error) if error.is_capture_refusal() => false,
        Err(error) => {
            tracing::debug!(%error, "a keep-alive fence cannot be queried; its values go");
            true
        }
    }
}

/// The allocation a keep-alive points to (its vtable dropped): equal for clones of one `Arc`.
fn address(value: &KeepAlive) -> *const () {
    Arc::as_ptr(value).cast::<()>()
}

/// Whether two keep-alives are the same allocation (ignoring the vtable).
#[cfg(test)]
fn same(a: &KeepAlive, b: &KeepAlive) -> bool {
    address(a) == address(b)
}

/// The addresses of `values`, for membership tests in O(1) each.
fn addresses(values: &[KeepAlive]) -> HashSet<*const ()> {
    values.iter().map(address).collect()
}

/// `values` without repeats (the first of each allocation kept), in order.
pub(super) fn deduplicated(values: &[KeepAlive]) -> Vec<KeepAlive> {
    let mut seen = HashSet::with_capacity(values.len());
    values
        .iter()
        .filter(|value| seen.insert(address(value)))
        .cloned()
        .collect()
}

/// Keep-alives of older generations, held until the launches that may use them have finished.
struct Retired<F> {
    values: Vec<KeepAlive>,
    /// Recorded behind the first launch after the update that retired `values`; `None` until
    /// that launch.
    fence: Option<F>,
}

/// The retirement rule of a graph executable's old keep-alive generations (see the module
/// docs). The current generation itself lives beside it, in the executable.
pub(super) struct Retirement<F> {
    /// Whether the current generation was launched since it became current.
    launched: bool,
    /// Oldest first; only the newest may lack a fence.
    retired: VecDeque<Retired<F>>,
}

impl<F> Default for Retirement<F> {
    fn default() -> Self {
        Self {
            launched: false,
            retired: VecDeque::new(),
        }
    }
}

impl<F: Fence> Retirement<F> {
    /// Notes a successful launch. When a retired generation still waits for its fence,
    /// `fence` makes one behind this launch (`None` when it cannot: the generation then waits
    /// for a later launch).
    #[inline]
    pub(super) fn launched(&mut self, fence: impl FnOnce() -> Option<F>) {
        self.launched = true;
        if let Some(newest) = self.retired.back_mut()
            && newest.fence.is_none()
        {
            newest.fence = fence();
        }
    }

    /// Replaces the current generation `current` by `next` (deduplicated): the old one is
    /// retired when it was launched (what appears again in `next` stays current instead), and
    /// dropped at once when it was not, since no launch used it. Generations whose launches
    /// have finished are dropped first.
    pub(super) fn update(&mut self, current: &mut Vec<KeepAlive>, next: &[KeepAlive]) {
        self.retire_finished();
        let old = std::mem::replace(current, deduplicated(next));
        if !std::mem::take(&mut self.launched) {
            return;
        }
        let staying = addresses(current);
        let old: Vec<KeepAlive> = old
            .into_iter()
            .filter(|value| !staying.contains(&address(value)))
            .collect();
        if old.is_empty() {
            return;
        }
        match self.retired.back_mut() {
            // Not launched since the previous update either: the next launch's fence covers
            // both, so they wait together.
            Some(newest) if newest.fence.is_none() => {
                let mut waiting = addresses(&newest.values);
                newest.values.extend(
                    old.into_iter()
                        .filter(|value| waiting.insert(address(value))),
                );
            }
            _ => self.retired.push_back(Retired {
                values: old,
                fence: None,
            }),
        }
    }

    /// Drops, oldest first, the retired generations whose fence has completed.
    pub(super) fn retire_finished(&mut self) {
        while self
            .retired
            .front()
            .is_some_and(|oldest| oldest.fence.as_ref().is_some_and(F::is_complete))
        {
            self.retired.pop_front();
        }
    }

    /// How many keep-alives the retired generations hold.
    pub(super) fn retired_len(&self) -> usize {
        self.retired
            .iter()
            .map(|retired| retired.values.len())
            .sum()
    }

    /// Every value the retired generations hold (for an executable being dropped, whose last
    /// launch's fence covers them all).
    pub(super) fn into_values(self) -> impl Iterator<Item = KeepAlive> {
        self.retired.into_iter().flat_map(|retired| retired.values)
    }

    /// How many retired generations wait (each for its fence, or the newest for a launch).
    #[cfg(test)]
    pub(super) fn pending_generations(&self) -> usize {
        self.retired.len()
    }
}

/// What dropped executables kept alive for launches still queued: each batch waits for a fence
/// behind its executable's last launch, and goes once that fence has completed. Looked at
/// whenever an executable is instantiated, updated or dropped, so it holds only batches whose
/// launches were still running at the last of those calls.
pub(super) struct Deferred<F> {
    waiting: Vec<(F, Vec<KeepAlive>)>,
}

impl<F> Deferred<F> {
    pub(super) const fn new() -> Self {
        Self {
            waiting: Vec::new(),
        }
    }
}

impl<F: Fence> Deferred<F> {
    /// Keeps `values` until `fence` completes.
    pub(super) fn push(&mut self, fence: F, values: Vec<KeepAlive>) {
        self.waiting.push((fence, values));
    }

    /// Takes out the batches whose fence has completed (for the caller to drop outside any
    /// lock: a keep-alive's drop may free memory or take other locks).
    pub(super) fn take_finished(&mut self) -> Vec<KeepAlive> {
        let mut finished = Vec::new();
        self.waiting.retain_mut(|(fence, values)| {
            if fence.is_complete() {
                finished.append(values);
                false
            } else {
                true
            }
        });
        finished
    }

    /// How many values wait.
    pub(super) fn len(&self) -> usize {
        self.waiting.iter().map(|(_, values)| values.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use std::any::Any;
    use std::sync::Weak;
    use std::sync::atomic::{AtomicBool, Ordering};

    use rstest::rstest;

    use super::*;

    /// A fence the test completes by hand.
    #[derive(Clone, Default)]
    struct TestFence(Arc<AtomicBool>);

    impl TestFence {
        fn complete(&self) {
            self.0.store(true, Ordering::Release);
        }
    }

    impl Fence for TestFence {
        fn is_complete(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    fn value(n: u64) -> KeepAlive {
        Arc::new(n)
    }

    #[test]
    fn a_fence_query_refused_by_a_capture_waits_and_any_other_failure_lets_go() {
        use crate::error::DriverError;
        use crate::graph::GraphError;
        use crate::sys;
        assert!(fence_query_complete(Ok(true)));
        assert!(!fence_query_complete(Ok(false)));
        let refused = DriverError::Graph(GraphError::Capturing {
            operation: "Event::query",
            reason: "a capture forbids it",
        });
        assert!(!fence_query_complete(Err(refused)), "asked again later");
        // What the driver answers for an event recorded into a capture that has ended, and for
        // a dead context: nothing left to wait for.
        for code in [
            sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS,
        ] {
            let failed = DriverError::Cuda {
                code: code.0,
                operation: "cuEventQuery",
            };
            assert!(fence_query_complete(Err(failed)), "{code:?}");
        }
    }

    #[test]
    fn a_dropped_executables_values_go_once_their_fence_completes_and_not_before() {
        let mut deferred = Deferred::<TestFence>::new();
        let (first, second) = (TestFence::default(), TestFence::default());
        let (a, b, c) = (value(1), value(2), value(3));
        let watch: Vec<Weak<dyn Any + Send + Sync>> = [&a, &b, &c].map(Arc::downgrade).to_vec();
        deferred.push(first.clone(), vec![a, b]);
        deferred.push(second.clone(), vec![c]);
        assert!(deferred.take_finished().is_empty());
        assert_eq!(deferred.len(), 3);
        second.complete();
        drop(deferred.take_finished());
        assert_eq!(deferred.len(), 2);
        assert!(watch[2].upgrade().is_none(), "the finished batch went");
        assert!(watch[0].upgrade().is_some(), "the running batch stays");
        first.complete();
        drop(deferred.take_finished());
        assert_eq!(deferred.len(), 0);
        assert!(watch.iter().all(|weak| weak.upgrade().is_none()));
    }

    #[test]
    fn repeats_are_kept_once() {
        let pool = value(0);
        let other = value(1);
        let unique = deduplicated(&[
            Arc::clone(&pool),
            Arc::clone(&other),
            Arc::clone(&pool),
            Arc::clone(&pool),
        ]);
        assert_eq!(unique.len(), 2);
        assert!(same(&unique[0], &pool) && same(&unique[1], &other));
    }

    #[test]
    fn large_generations_are_deduplicated_and_retired_with_each_value_once() {
        // Thousands of keep-alives per generation, each given twice: kept once, in order, and
        // the half that leaves at each update retired once. (Performance is the bench's
        // business, not a unit test's: the bookkeeping hashes addresses instead of comparing
        // every pair.)
        const N: u64 = 5_000;
        let shared: Vec<KeepAlive> = (0..N).map(value).collect();
        let mut next: Vec<KeepAlive> = shared.iter().chain(&shared).cloned().collect();
        next.extend((N..2 * N).map(value));
        let mut current = deduplicated(&next);
        assert_eq!(current.len(), 2 * N as usize, "each repeat kept once");
        assert!(same(&current[0], &shared[0]) && same(&current[1], &shared[1]));
        let mut retirement = Retirement::<TestFence>::default();
        for round in 0..2 {
            retirement.launched(|| None);
            // The shared half stays current; the other half leaves, once per update.
            let mut following = shared.clone();
            following.extend((0..N).map(|n| value(n + (round + 2) * N)));
            retirement.update(&mut current, &following);
        }
        // Both updates wait for the same (not yet made) fence: one generation, no repeats.
        assert_eq!(retirement.pending_generations(), 1);
        assert_eq!(retirement.retired_len(), 2 * N as usize);
    }

    #[rstest]
    #[case::every_launch_finishes_before_the_next_update(1)]
    #[case::fences_complete_in_bursts(64)]
    fn a_million_update_loops_hold_a_bounded_number_of_keep_alives(#[case] burst: usize) {
        // The same pool in every generation (deduplicated) and a fresh buffer per update.
        let pool = value(u64::MAX);
        let mut current = deduplicated(&[Arc::clone(&pool), value(0)]);
        let mut retirement = Retirement::<TestFence>::default();
        let mut fences: Vec<TestFence> = Vec::new();
        let mut most = 0;
        for round in 1..=1_000_000u64 {
            retirement.launched(|| {
                let fence = TestFence::default();
                fences.push(fence.clone());
                Some(fence)
            });
            if fences.len() >= burst {
                fences.drain(..).for_each(|fence| fence.complete());
            }
            let graph = [Arc::clone(&pool), value(round), Arc::clone(&pool)];
            retirement.update(&mut current, &graph);
            assert_eq!(current.len(), 2, "the pool is kept once");
            most = most.max(retirement.retired_len() + current.len());
        }
        // Current (2) plus at most `burst` generations of one buffer each in flight, plus the
        // one retired by the last update.
        assert!(most <= burst + 3, "held {most} keep-alives at once");
        assert_eq!(
            Arc::strong_count(&pool),
            2,
            "ours and the current generation's"
        );
    }

    #[test]
    fn updates_without_launches_retire_nothing_and_hold_nothing() {
        let mut current = vec![value(0)];
        let mut retirement = Retirement::<TestFence>::default();
        let first = Arc::downgrade(&current[0]);
        for round in 1..=100_000 {
            retirement.update(&mut current, &[value(round)]);
        }
        assert_eq!(retirement.retired_len(), 0);
        assert_eq!(retirement.pending_generations(), 0);
        assert!(first.upgrade().is_none(), "never launched: dropped at once");
    }

    #[test]
    fn a_retired_generation_lives_until_the_fence_after_the_next_launch_completes() {
        let mut current = vec![value(0)];
        let old: Weak<dyn std::any::Any + Send + Sync> = Arc::downgrade(&current[0]);
        let mut retirement = Retirement::<TestFence>::default();

        retirement.launched(|| panic!("nothing retired yet: no fence is needed"));
        retirement.update(&mut current, &[value(1)]);
        // Updated again before any launch: still needed by the launch before the first update.
        retirement.update(&mut current, &[value(2)]);
        assert!(old.upgrade().is_some());
        assert_eq!(retirement.pending_generations(), 1);

        // A launch that cannot make a fence (say, onto a capturing stream) leaves it waiting.
        retirement.launched(|| None);
        retirement.update(&mut current, &[value(3)]);
        assert!(old.upgrade().is_some());

        let fence = TestFence::default();
        let made = fence.clone();
        retirement.launched(move || Some(made));
        retirement.update(&mut current, &[value(4)]);
        assert!(old.upgrade().is_some(), "the fence has not completed");
        assert_eq!(retirement.pending_generations(), 2);

        fence.complete();
        retirement.retire_finished();
        assert!(
            old.upgrade().is_none(),
            "dropped once its launches finished"
        );
        // The generation retired after the fenced launch waits for the next launch's fence.
        assert_eq!(retirement.pending_generations(), 1);
    }

    #[test]
    fn a_value_in_the_next_generation_stays_current_and_is_not_retired() {
        let shared = value(7);
        let mut current = vec![Arc::clone(&shared), value(0)];
        let mut retirement = Retirement::<TestFence>::default();
        retirement.launched(|| None);
        retirement.update(&mut current, &[Arc::clone(&shared)]);
        assert_eq!(retirement.retired_len(), 1, "only the buffer that left");
        assert_eq!(current.len(), 1);
    }
}
