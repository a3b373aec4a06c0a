//! [`DependencyGraph`]: the one dependency graph of cuweave (streams in the stream
//! coordinator, operations in the event layer's operation coordinator), with cycle detection.
//! Pure logic, no CUDA.

use std::collections::{BTreeMap, BTreeSet};

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

    /// A path of edges from `from` to `to` (both included), if any.
    pub fn path(&self, from: u64, to: u64) -> Option<Vec<u64>> {
        let mut stack = vec![(from, vec![from])];
        let mut seen = BTreeSet::new();
        while let Some((node, path)) = stack.pop() {
            if node == to {
                return Some(path);
            }
            if !seen.insert(node) {
                continue;
            }
            for &next in self.edges.get(&node).into_iter().flatten() {
                let mut longer = path.clone();
                longer.push(next);
                stack.push((next, longer));
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

    #[test]
    fn ping_pong_is_one_cycle_of_two() {
        let mut graph = DependencyGraph::new();
        graph.add_unchecked(10, 20);
        graph.add_unchecked(20, 10);
        assert_eq!(graph.cycles(), vec![vec![10, 20]]);
        assert_eq!(graph.elementary_cycles(), vec![vec![10, 20]]);
    }
}
