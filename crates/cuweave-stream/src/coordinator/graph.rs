//! [`DependencyGraph`]: the one dependency graph of cuweave (streams in the stream
//! coordinator, operations in the event layer's operation coordinator), with cycle detection.
//! Pure logic, no CUDA.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use super::cycles;

/// A directed graph of ids (streams, or operations): an edge `dependent -> prerequisite` means
/// the dependent waits for the prerequisite's work.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DependencyGraph {
    edges: BTreeMap<u64, BTreeSet<u64>>,
}

impl DependencyGraph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `dependent -> prerequisite` unless it would close a cycle; then returns the cycle,
    /// starting at `dependent` (each id waits on the next, the last on `dependent`).
    /// Returns `Ok(false)` when the edge was already there.
    pub fn try_add(&mut self, dependent: u64, prerequisite: u64) -> Result<bool, Vec<u64>> {
        if dependent == prerequisite {
            return Err(vec![dependent]);
        }
        if let Some(mut path) = self.path(prerequisite, dependent) {
            // path: prerequisite .. dependent; the cycle is dependent, prerequisite, .., (dependent).
            path.pop();
            let mut cycle = vec![dependent];
            cycle.extend(path);
            return Err(cycle);
        }
        Ok(self.add_unchecked(dependent, prerequisite))
    }

    /// Adds an edge without checking for cycles (to describe a graph found elsewhere; see
    /// [`cycles`](Self::cycles)). Returns whether it is new.
    pub fn add_unchecked(&mut self, dependent: u64, prerequisite: u64) -> bool {
        self.edges.entry(prerequisite).or_default();
        self.edges
            .entry(dependent)
            .or_default()
            .insert(prerequisite)
    }

    /// Removes a stream and every edge touching it.
    pub fn remove(&mut self, stream: u64) {
        self.edges.remove(&stream);
        for targets in self.edges.values_mut() {
            targets.remove(&stream);
        }
    }

    /// Every edge, as `(dependent, prerequisite)`, sorted.
    pub fn edges(&self) -> Vec<(u64, u64)> {
        self.edges
            .iter()
            .flat_map(|(&from, to)| to.iter().map(move |&t| (from, t)))
            .collect()
    }

    /// The streams `dependent` waits on directly.
    pub fn prerequisites(&self, dependent: u64) -> Vec<u64> {
        self.edges
            .get(&dependent)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default()
    }

    /// A path of edges from `from` to `to` (both included), if any: the first one a depth-first
    /// walk meets, taking each node's prerequisites from the largest id down. O(nodes + edges)
    /// (times a map lookup); O(log nodes) when nothing leads to `to` (it is in no edge).
    pub fn path(&self, from: u64, to: u64) -> Option<Vec<u64>> {
        if from != to && !self.edges.contains_key(&to) {
            // Every prerequisite is a node (`add_unchecked` makes it one, `remove` drops the
            // edges into a node with it): a walk can reach `to` only if it is one. Building a
            // chain stage by stage adds each stage as a new dependent, so `try_add` answers at
            // once instead of walking the whole chain.
            return None;
        }
        // Each stack entry is a node and the node it was reached from. The first time a node is
        // taken off the stack its parent is kept (the walk goes on from there), and the path is
        // rebuilt from the parents once, at the end: copying the path on every step made one
        // query over a chain of n nodes O(n^2).
        let mut stack: Vec<(u64, Option<u64>)> = vec![(from, None)];
        let mut parents: HashMap<u64, Option<u64>> = HashMap::new();
        while let Some((node, parent)) = stack.pop() {
            if node == to {
                let mut path = vec![to];
                let mut at = parent;
                while let Some(previous) = at {
                    path.push(previous);
                    at = parents[&previous];
                }
                path.reverse();
                return Some(path);
            }
            match parents.entry(node) {
                Entry::Occupied(_) => continue,
                Entry::Vacant(slot) => {
                    slot.insert(parent);
                }
            }
            for &next in self.edges.get(&node).into_iter().flatten() {
                stack.push((next, Some(node)));
            }
        }
        None
    }

    /// Whether the graph has a cycle.
    pub fn has_cycles(&self) -> bool {
        !self.cycles().is_empty()
    }

    /// One cycle through each strongly connected part of the graph that has one (Tarjan's
    /// algorithm), each starting at its smallest id.
    pub fn cycles(&self) -> Vec<Vec<u64>> {
        let mut cycles = Vec::new();
        for component in self.strongly_connected() {
            let start = component[0];
            let self_loop = self.edges.get(&start).is_some_and(|to| to.contains(&start));
            if component.len() == 1 && !self_loop {
                continue;
            }
            if self_loop && component.len() == 1 {
                cycles.push(vec![start]);
                continue;
            }
            // A path back to `start` through one of its successors inside the component.
            let members: BTreeSet<u64> = component.iter().copied().collect();
            let inner = self.restricted(&members);
            let cycle = inner
                .prerequisites(start)
                .into_iter()
                .find_map(|next| inner.path(next, start))
                .map(|mut path| {
                    path.pop();
                    let mut cycle = vec![start];
                    cycle.extend(path);
                    cycle
                });
            cycles.extend(cycle);
        }
        cycles
    }

    fn restricted(&self, members: &BTreeSet<u64>) -> Self {
        let mut graph = Self::new();
        for (from, to) in self.edges() {
            if members.contains(&from) && members.contains(&to) {
                graph.add_unchecked(from, to);
            }
        }
        graph
    }

    /// The nodes, sorted, and each one's prerequisites as indices into that list.
    fn indexed(&self) -> (Vec<u64>, Vec<Vec<usize>>) {
        let nodes: Vec<u64> = self.edges.keys().copied().collect();
        let index: BTreeMap<u64, usize> = nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let edges = nodes
            .iter()
            .map(|node| self.edges[node].iter().map(|to| index[to]).collect())
            .collect();
        (nodes, edges)
    }

    /// Strongly connected components, each sorted, in order.
    fn strongly_connected(&self) -> Vec<Vec<u64>> {
        let (nodes, edges) = self.indexed();
        let component = cycles::components(&edges, 0);
        let mut parts: BTreeMap<usize, Vec<u64>> = BTreeMap::new();
        for (i, &c) in component.iter().enumerate() {
            parts.entry(c).or_default().push(nodes[i]);
        }
        let mut out: Vec<Vec<u64>> = parts.into_values().collect();
        out.sort();
        out
    }

    /// Every elementary cycle, each listed once, starting at its smallest id and following the
    /// edges (`[a, b]`: `a` waits for `b`, which waits for `a`), ordered by their first id
    /// (Johnson's algorithm with blocked sets, iterative: O((nodes + edges) x (cycles + 1))).
    /// Their number can grow exponentially with the graph's density; dependency graphs of real
    /// work have few.
    pub fn elementary_cycles(&self) -> Vec<Vec<u64>> {
        let (nodes, edges) = self.indexed();
        cycles::elementary_cycles(&edges)
            .into_iter()
            .map(|cycle| cycle.into_iter().map(|i| nodes[i]).collect())
            .collect()
    }

    /// Removes every edge and node.
    pub fn clear(&mut self) {
        self.edges.clear();
    }

    /// Nodes in the graph.
    pub fn len(&self) -> usize {
        self.edges.len()
    }

    /// Whether the graph has no node.
    pub fn is_empty(&self) -> bool {
        self.edges.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edge_closing_a_cycle_is_refused_with_the_cycle() {
        let mut graph = DependencyGraph::new();
        assert_eq!(graph.try_add(1, 2), Ok(true));
        assert_eq!(graph.try_add(2, 3), Ok(true));
        assert_eq!(graph.try_add(1, 2), Ok(false));
        // 3 waiting on 1 would make 3 -> 1 -> 2 -> 3.
        assert_eq!(graph.try_add(3, 1), Err(vec![3, 1, 2]));
        assert_eq!(graph.try_add(4, 4), Err(vec![4]));
        assert!(!graph.has_cycles());
        assert_eq!(graph.edges(), vec![(1, 2), (2, 3)]);
    }

    #[test]
    fn diamonds_are_not_cycles() {
        let mut graph = DependencyGraph::new();
        for (a, b) in [(1, 2), (1, 3), (2, 4), (3, 4)] {
            graph.try_add(a, b).unwrap();
        }
        assert!(!graph.has_cycles());
        assert_eq!(graph.path(1, 4).map(|p| p.len()), Some(3));
        assert_eq!(graph.path(4, 1), None);
    }

    #[test]
    fn cycles_reports_one_cycle_per_strongly_connected_part() {
        let mut graph = DependencyGraph::new();
        for (a, b) in [(1, 2), (2, 3), (3, 1), (5, 6), (6, 5), (7, 7), (3, 8)] {
            graph.add_unchecked(a, b);
        }
        let cycles = graph.cycles();
        assert_eq!(cycles, vec![vec![1, 2, 3], vec![5, 6], vec![7]]);
        assert!(graph.has_cycles());
        for cycle in &cycles {
            for (i, &node) in cycle.iter().enumerate() {
                let next = cycle[(i + 1) % cycle.len()];
                assert!(
                    graph.prerequisites(node).contains(&next),
                    "{cycle:?} is a real cycle"
                );
            }
        }
        graph.remove(1);
        assert_eq!(graph.cycles(), vec![vec![5, 6], vec![7]]);
        assert_eq!(graph.elementary_cycles(), vec![vec![5, 6], vec![7]]);
        graph.clear();
        assert!(graph.is_empty() && !graph.has_cycles());
    }

    /// The walk `path` made before it kept parents: the whole path copied onto every stack
    /// entry. The paths it found are the ones to keep finding.
    fn copying_path(graph: &DependencyGraph, from: u64, to: u64) -> Option<Vec<u64>> {
        let mut stack = vec![(from, vec![from])];
        let mut seen = BTreeSet::new();
        while let Some((node, path)) = stack.pop() {
            if node == to {
                return Some(path);
            }
            if !seen.insert(node) {
                continue;
            }
            for next in graph.prerequisites(node) {
                let mut longer = path.clone();
                longer.push(next);
                stack.push((next, longer));
            }
        }
        None
    }

    #[test]
    fn paths_are_the_ones_the_copying_walk_found() {
        // The same graphs on every run.
        let mut lcg = cuweave_test_support::lcg::Lcg::new(0x2545_f491_4f6c_dd1d);
        let mut next = move |bound: u64| lcg.below(bound);
        for (nodes, edges) in [(6, 4), (12, 20), (24, 40), (24, 120), (40, 200)] {
            let mut graph = DependencyGraph::new();
            for _ in 0..edges {
                graph.add_unchecked(next(nodes), next(nodes));
            }
            graph.remove(next(nodes));
            // One id past the nodes: in no edge.
            for from in 0..=nodes {
                for to in 0..=nodes {
                    assert_eq!(
                        graph.path(from, to),
                        copying_path(&graph, from, to),
                        "{from} -> {to} in {:?}",
                        graph.edges()
                    );
                }
            }
        }
    }

    #[test]
    fn a_hundred_thousand_stage_chain_built_with_try_add_is_quick_and_its_ring_exact() {
        const STAGES: u64 = 100_000;
        let started = std::time::Instant::now();
        let mut graph = DependencyGraph::new();
        for stage in 1..STAGES {
            assert_eq!(graph.try_add(stage, stage - 1), Ok(true), "stage {stage}");
        }
        assert_eq!(graph.try_add(STAGES / 2, STAGES / 2 - 1), Ok(false));
        assert_eq!(graph.len(), STAGES as usize);

        let descending: Vec<u64> = (0..STAGES).rev().collect();
        assert_eq!(graph.path(STAGES - 1, 0).as_deref(), Some(&descending[..]));
        assert_eq!(graph.path(0, STAGES - 1), None);
        // Closing the ring: 0 would wait on the last stage, which waits (through every stage)
        // on 0. The refusal names the ring from 0, each stage waiting on the next.
        let mut ring = vec![0];
        ring.extend(&descending[..descending.len() - 1]);
        assert_eq!(graph.try_add(0, STAGES - 1), Err(ring.clone()));
        assert!(!graph.has_cycles(), "a refused edge is not added");

        graph.add_unchecked(0, STAGES - 1);
        assert_eq!(graph.cycles(), vec![ring]);
        // Far under the 160 s that 10^4 stages took while every step copied its path (O(n^3)
        // to build); generous for an unoptimised build on a loaded machine.
        let elapsed = started.elapsed();
        assert!(
            elapsed < std::time::Duration::from_secs(20),
            "{STAGES} stages took {elapsed:?}"
        );
    }

    #[test]
    fn a_chain_whose_every_check_walks_it_whole_is_exact() {
        // Every stage is already a node (a sink waits on all of them), so no check can answer
        // at once: each `try_add(stage, stage - 1)` walks the chain below the stage.
        const STAGES: u64 = 1_000;
        const SINK: u64 = u64::MAX;
        let mut graph = DependencyGraph::new();
        for stage in 0..STAGES {
            graph.add_unchecked(SINK, stage);
        }
        for stage in 1..STAGES {
            assert_eq!(graph.try_add(stage, stage - 1), Ok(true), "stage {stage}");
        }
        let mut ring = vec![0];
        ring.extend((1..STAGES).rev());
        assert_eq!(graph.try_add(0, STAGES - 1), Err(ring));
        // The sink waits on every stage: its path down to 0 is the first one a walk from the
        // largest prerequisite down meets.
        let through_the_chain: Vec<u64> = std::iter::once(SINK).chain((0..STAGES).rev()).collect();
        assert_eq!(graph.path(SINK, 0), Some(through_the_chain));
        assert_eq!(graph.path(SINK, 0), copying_path(&graph, SINK, 0));
    }

    #[test]
    fn ping_pong_is_one_cycle_of_two() {
        let mut graph = DependencyGraph::new();
        graph.add_unchecked(10, 20);
        graph.add_unchecked(20, 10);
        assert_eq!(graph.cycles(), vec![vec![10, 20]]);
        assert_eq!(graph.elementary_cycles(), vec![vec![10, 20]]);
    }
}
