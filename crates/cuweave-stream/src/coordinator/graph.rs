//! [`DependencyGraph`]: the one dependency graph of cuweave (streams in the stream
//! coordinator, operations in the event layer's operation coordinator), with cycle detection.
//! Pure logic, no CUDA.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use super::cycles;

/// A directed graph of ids (streams, or operations): an edge `dependent -> prerequisite` means
/// the dependent waits for the prerequisite's work.
///
/// Every operation costs about the part of the graph it concerns, not the whole graph: adding
/// or removing a node touches only its own edges (planners retire 10^5 stages one by one), a
/// path search stops as soon as either end's side of the graph is exhausted, and the cycle
/// queries are linear in the graph (Tarjan's components, then one walk per component).
#[derive(Clone, Default)]
pub struct DependencyGraph {
    /// Each node's prerequisites (the nodes it waits on).
    edges: BTreeMap<u64, BTreeSet<u64>>,
    /// Each node's dependents (the nodes waiting on it): the reverse of `edges`, with the same
    /// nodes as keys, so that `remove` reaches the edges into a node without scanning every
    /// node, and `path` can search backwards from its target.
    dependents: BTreeMap<u64, BTreeSet<u64>>,
}

// The reverse index follows from `edges`: equality and the debug form are those of `edges`
// alone (as they were before the index existed).
impl PartialEq for DependencyGraph {
    fn eq(&self, other: &Self) -> bool {
        self.edges == other.edges
    }
}

impl Eq for DependencyGraph {}

impl fmt::Debug for DependencyGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DependencyGraph")
            .field("edges", &self.edges)
            .finish()
    }
}

/// No parent, or no node, in the index-space walks of [`DependencyGraph::cycles`].
const NONE: usize = usize::MAX;

impl DependencyGraph {
    /// An empty graph.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `dependent -> prerequisite` unless it would close a cycle; then returns the cycle,
    /// starting at `dependent` (each id waits on the next, the last on `dependent`).
    /// Returns `Ok(false)` when the edge was already there. Costs one [`path`](Self::path)
    /// search.
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
    /// [`cycles`](Self::cycles)). Returns whether it is new. O(log nodes).
    pub fn add_unchecked(&mut self, dependent: u64, prerequisite: u64) -> bool {
        self.edges.entry(prerequisite).or_default();
        self.dependents.entry(dependent).or_default();
        let new = self
            .edges
            .entry(dependent)
            .or_default()
            .insert(prerequisite);
        self.dependents
            .entry(prerequisite)
            .or_default()
            .insert(dependent);
        new
    }

    /// Removes a stream and every edge touching it. Costs its own edges (times a map lookup),
    /// whatever the size of the graph.
    pub fn remove(&mut self, stream: u64) {
        if let Some(prerequisites) = self.edges.remove(&stream) {
            for prerequisite in prerequisites {
                if let Some(dependents) = self.dependents.get_mut(&prerequisite) {
                    dependents.remove(&stream);
                }
            }
        }
        if let Some(dependents) = self.dependents.remove(&stream) {
            for dependent in dependents {
                if let Some(prerequisites) = self.edges.get_mut(&dependent) {
                    prerequisites.remove(&stream);
                }
            }
        }
    }

    /// Every edge, as `(dependent, prerequisite)`, sorted.
    pub fn edges(&self) -> Vec<(u64, u64)> {
        self.edges
            .iter()
            .flat_map(|(&from, to)| to.iter().map(move |&t| (from, t)))
            .collect()
    }

    /// The streams `dependent` waits on directly, sorted.
    pub fn prerequisites(&self, dependent: u64) -> Vec<u64> {
        self.edges
            .get(&dependent)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The streams that wait on `prerequisite` directly, sorted.
    pub fn dependents(&self, prerequisite: u64) -> Vec<u64> {
        self.dependents
            .get(&prerequisite)
            .map(|set| set.iter().copied().collect())
            .unwrap_or_default()
    }

    /// A path of edges from `from` to `to` (both included), if any: the first one a depth-first
    /// walk meets, taking each node's prerequisites from the largest id down.
    ///
    /// The walk runs beside a backward search from `to` over dependents, each side taking turns
    /// by the edges it has looked at. When the backward side runs out without meeting `from`,
    /// there is no path; when it runs out having met it, it knows every node that can reach
    /// `to`, and the walk skips the others (which never changes the path it meets: a node that
    /// cannot reach `to` only hides nodes that cannot either). So the answer costs about the
    /// smaller of the two sides when there is no path (a chain grown at its top, whose new
    /// stage is already a node, answers at once), and at most twice the walk when there is one;
    /// O(log nodes) when nothing leads to `to` (it is in no edge).
    pub fn path(&self, from: u64, to: u64) -> Option<Vec<u64>> {
        if from == to {
            return Some(vec![to]);
        }
        if !self.edges.contains_key(&to) || !self.edges.contains_key(&from) {
            // Every prerequisite is a node (`add_unchecked` makes it one, `remove` drops the
            // edges into a node with it): a walk can reach `to` only if it is one, and leaves
            // `from` only if it is one. Building a chain stage by stage adds each stage as a
            // new dependent, so `try_add` answers at once instead of walking the whole chain.
            return None;
        }
        // Each stack entry is a node and the node it was reached from. The first time a node is
        // taken off the stack its parent is kept (the walk goes on from there), and the path is
        // rebuilt from the parents once, at the end: copying the path on every step made one
        // query over a chain of n nodes O(n^2).
        let mut stack: Vec<(u64, Option<u64>)> = vec![(from, None)];
        let mut parents: HashMap<u64, Option<u64>> = HashMap::new();
        // The backward side: nodes known to reach `to`, and those whose dependents are unread.
        let mut reaching: HashSet<u64> = HashSet::from([to]);
        let mut frontier: Vec<u64> = vec![to];
        let mut met_from = false;
        let (mut walked, mut searched) = (0usize, 0usize);
        loop {
            let reaching_known = frontier.is_empty();
            if !reaching_known && searched < walked {
                let node = frontier.pop().expect("the frontier is not empty");
                let dependents = &self.dependents[&node];
                searched += 1 + dependents.len();
                for &dependent in dependents {
                    if reaching.insert(dependent) {
                        met_from |= dependent == from;
                        frontier.push(dependent);
                    }
                }
                if frontier.is_empty() && !met_from {
                    return None;
                }
                continue;
            }
            let (node, parent) = stack.pop()?;
            walked += 1;
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
            if reaching_known && !reaching.contains(&node) {
                continue;
            }
            match parents.entry(node) {
                Entry::Occupied(_) => continue,
                Entry::Vacant(slot) => {
                    slot.insert(parent);
                }
            }
            for &next in self.edges.get(&node).into_iter().flatten() {
                walked += 1;
                stack.push((next, Some(node)));
            }
        }
    }

    /// Whether the graph has a cycle: a self-loop, or a strongly connected part of more than
    /// one node. Linear in the graph (times a map lookup per edge).
    pub fn has_cycles(&self) -> bool {
        if self.edges.iter().any(|(node, to)| to.contains(node)) {
            return true;
        }
        let (_, edges) = self.indexed();
        let component = cycles::components(&edges, 0);
        let mut seen = vec![false; component.len()];
        component
            .into_iter()
            .any(|c| std::mem::replace(&mut seen[c], true))
    }

    /// One cycle through each strongly connected part of the graph that has one (Tarjan's
    /// algorithm), each starting at its smallest id. Linear in the graph (times a map lookup
    /// per edge): each part's cycle is found by a walk over that part's own edges.
    pub fn cycles(&self) -> Vec<Vec<u64>> {
        let (nodes, edges) = self.indexed();
        let (component, parts) = Self::parts(&edges);
        let mut cycles = Vec::new();
        // Parts are disjoint and each walk stays inside its part, so one set of marks serves
        // every walk.
        let mut seen = vec![false; nodes.len()];
        let mut parents = vec![NONE; nodes.len()];
        for part in parts {
            let start = part[0];
            let c = component[start];
            let self_loop = edges[start].binary_search(&start).is_ok();
            if part.len() == 1 {
                if self_loop {
                    cycles.push(vec![nodes[start]]);
                }
                continue;
            }
            // A path back to `start` from its first successor inside the part (the smallest,
            // which is `start` itself when it has a self-loop): inside a strongly connected
            // part the first one always leads back.
            let Some(&first) = edges[start].iter().find(|&&next| component[next] == c) else {
                continue;
            };
            let mut stack: Vec<(usize, usize)> = vec![(first, NONE)];
            while let Some((node, parent)) = stack.pop() {
                if node == start {
                    // path: first .. start; the cycle is start, first, .., (start).
                    let mut path = vec![];
                    let mut at = parent;
                    while at != NONE {
                        path.push(nodes[at]);
                        at = parents[at];
                    }
                    path.push(nodes[start]);
                    path.reverse();
                    cycles.push(path);
                    break;
                }
                if std::mem::replace(&mut seen[node], true) {
                    continue;
                }
                parents[node] = parent;
                for &next in &edges[node] {
                    if component[next] == c {
                        stack.push((next, node));
                    }
                }
            }
        }
        cycles
    }

    /// The nodes, sorted, and each one's prerequisites as indices into that list (sorted).
    fn indexed(&self) -> (Vec<u64>, Vec<Vec<usize>>) {
        let nodes: Vec<u64> = self.edges.keys().copied().collect();
        let index: HashMap<u64, usize> = nodes.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        let edges = self
            .edges
            .values()
            .map(|to| to.iter().map(|to| index[to]).collect())
            .collect();
        (nodes, edges)
    }

    /// Strongly connected components of an indexed graph: each node's component number, and
    /// the components as sorted lists of nodes, ordered by their smallest node.
    fn parts(edges: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
        let component = cycles::components(edges, 0);
        // Component numbers in the order of their smallest node.
        let mut rank = vec![NONE; edges.len()];
        let mut parts: Vec<Vec<usize>> = Vec::new();
        for (node, &c) in component.iter().enumerate() {
            if rank[c] == NONE {
                rank[c] = parts.len();
                parts.push(Vec::new());
            }
            parts[rank[c]].push(node);
        }
        (component, parts)
    }

    /// Every elementary cycle, each listed once, starting at its smallest id and following the
    /// edges (`[a, b]`: `a` waits for `b`, which waits for `a`), ordered by their first id
    /// (Johnson's algorithm with blocked sets, iterative, run on each strongly connected part
    /// with a cycle: O((part nodes + part edges) x (part cycles + 1)) summed over the parts).
    /// Their number can grow exponentially with the graph's density; dependency graphs of real
    /// work have few.
    pub fn elementary_cycles(&self) -> Vec<Vec<u64>> {
        let (nodes, edges) = self.indexed();
        let (component, parts) = Self::parts(&edges);
        let mut local = vec![NONE; nodes.len()];
        let mut found: Vec<Vec<u64>> = Vec::new();
        for part in parts {
            let c = component[part[0]];
            if part.len() == 1 && edges[part[0]].binary_search(&part[0]).is_err() {
                continue;
            }
            // Every cycle lies inside one part, and a part's nodes keep their order, so Johnson
            // on the part alone lists its cycles in the order it lists them on the whole graph.
            for (i, &node) in part.iter().enumerate() {
                local[node] = i;
            }
            let inner: Vec<Vec<usize>> = part
                .iter()
                .map(|&node| {
                    edges[node]
                        .iter()
                        .filter(|&&to| component[to] == c)
                        .map(|&to| local[to])
                        .collect()
                })
                .collect();
            found.extend(
                cycles::elementary_cycles(&inner)
                    .into_iter()
                    .map(|cycle| cycle.into_iter().map(|i| nodes[part[i]]).collect()),
            );
        }
        // Parts are ordered by their smallest node, not by every cycle's first one; the sort is
        // stable, so the cycles sharing a first node keep Johnson's order.
        found.sort_by_key(|cycle| cycle[0]);
        found
    }

    /// Removes every edge and node.
    pub fn clear(&mut self) {
        self.edges.clear();
        self.dependents.clear();
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
#[path = "graph_tests.rs"]
mod tests;
