//! The graph algorithms behind [`DependencyGraph`](super::DependencyGraph), over nodes
//! numbered `0..n`: strongly connected components (Tarjan) and every elementary cycle
//! (Johnson), both iterative. Pure logic, no CUDA.

/// Every elementary cycle of the directed graph whose node `i` has edges to `edges[i]`.
///
/// Each cycle is listed once, starting at its smallest node and following the edges
/// (`[a, b, c]` means `a → b → c → a`); cycles are ordered by their first node. A self-loop is
/// the cycle `[a]`. This is Johnson's algorithm: take the smallest node `s` that lies in a
/// non-trivial strongly connected component of the graph restricted to nodes `>= s`, list the
/// cycles through `s` inside that component with a depth-first walk, then go on from `s + 1`.
/// The walk blocks a node once it has been searched without finding a way back to `s`, and
/// unblocks it only when a node it leads to joins a cycle, so no fruitless path is walked twice:
/// the whole costs O((nodes + edges) x (cycles + 1)), however many paths the graph has. Both the
/// component search and the walk are iterative, so long dependency chains cannot overflow the
/// stack. The number of cycles itself can grow exponentially with the graph's density;
/// dependency graphs of real work have few.
pub(crate) fn elementary_cycles(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = edges.len();
    let mut cycles = Vec::new();
    // Johnson's `blocked` and `B` sets: a blocked node is on the path or cannot reach `start`
    // avoiding it; `waiting[w]` lists the blocked nodes to unblock when `w` is.
    let mut blocked = vec![false; n];
    let mut waiting: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut from = 0;
    while from < n {
        let component = components(edges, from);
        let Some(start) = (from..n).find(|&v| {
            let c = component[v];
            c != usize::MAX
                && (edges[v].contains(&v)
                    || edges[v]
                        .iter()
                        .any(|&w| w != v && w >= from && w < n && component[w] == c))
        }) else {
            break;
        };
        let in_scope = |w: usize| w < n && w >= start && component[w] == component[start];
        for v in (start..n).filter(|&v| in_scope(v)) {
            blocked[v] = false;
            waiting[v].clear();
        }
        // (node, index of the next edge to try, whether a cycle was found below it)
        let mut stack: Vec<(usize, usize, bool)> = vec![(start, 0, false)];
        blocked[start] = true;
        while let Some(&mut (node, ref mut next, ref mut found)) = stack.last_mut() {
            if let Some(&target) = edges[node].get(*next) {
                *next += 1;
                if target == start {
                    *found = true;
                    cycles.push(stack.iter().map(|&(node, _, _)| node).collect());
                } else if in_scope(target) && !blocked[target] {
                    blocked[target] = true;
                    stack.push((target, 0, false));
                }
            } else {
                let found = *found;
                if found {
                    unblock(node, &mut blocked, &mut waiting);
                } else {
                    for &target in &edges[node] {
                        if in_scope(target) && !waiting[target].contains(&node) {
                            waiting[target].push(node);
                        }
                    }
                }
                stack.pop();
                if let Some(parent) = stack.last_mut() {
                    parent.2 |= found;
                }
            }
        }
        from = start + 1;
    }
    cycles
}

/// Unblocks `node` and, transitively, the nodes waiting for it (Johnson's `unblock`, iterative).
fn unblock(node: usize, blocked: &mut [bool], waiting: &mut [Vec<usize>]) {
    let mut work = vec![node];
    while let Some(v) = work.pop() {
        if !blocked[v] {
            continue;
        }
        blocked[v] = false;
        work.append(&mut waiting[v]);
    }
}

/// Strongly connected components (Tarjan, iterative) of the graph restricted to nodes
/// `>= from`: `result[v]` is `v`'s component number, `usize::MAX` for nodes below `from`.
pub(crate) fn components(edges: &[Vec<usize>], from: usize) -> Vec<usize> {
    let n = edges.len();
    const UNSEEN: usize = usize::MAX;
    let mut index = vec![UNSEEN; n];
    let mut low = vec![0; n];
    let mut on_stack = vec![false; n];
    let mut component = vec![UNSEEN; n];
    let mut stack = Vec::new();
    let mut next_index = 0;
    let mut next_component = 0;
    for root in from..n {
        if index[root] != UNSEEN {
            continue;
        }
        let mut call: Vec<(usize, usize)> = vec![(root, 0)];
        index[root] = next_index;
        low[root] = next_index;
        next_index += 1;
        stack.push(root);
        on_stack[root] = true;
        while let Some(&mut (v, ref mut next)) = call.last_mut() {
            if let Some(&w) = edges[v].get(*next) {
                *next += 1;
                if w < from || w >= n {
                    continue;
                }
                if index[w] == UNSEEN {
                    index[w] = next_index;
                    low[w] = next_index;
                    next_index += 1;
                    stack.push(w);
                    on_stack[w] = true;
                    call.push((w, 0));
                } else if on_stack[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                call.pop();
                if let Some(&(parent, _)) = call.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] == index[v] {
                    while let Some(w) = stack.pop() {
                        on_stack[w] = false;
                        component[w] = next_component;
                        if w == v {
                            break;
                        }
                    }
                    next_component += 1;
                }
            }
        }
    }
    component
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::elementary_cycles;

    #[rstest]
    #[case::empty(vec![], vec![])]
    #[case::chain(vec![vec![1], vec![2], vec![]], vec![])]
    #[case::diamond(vec![vec![1, 2], vec![3], vec![3], vec![]], vec![])]
    #[case::self_loop(vec![vec![0]], vec![vec![0]])]
    #[case::two_cycle(vec![vec![1], vec![0]], vec![vec![0, 1]])]
    #[case::triangle(vec![vec![1], vec![2], vec![0]], vec![vec![0, 1, 2]])]
    #[case::two_disjoint(
        vec![vec![1], vec![0], vec![3], vec![2]],
        vec![vec![0, 1], vec![2, 3]]
    )]
    #[case::sharing_a_node(
        vec![vec![1, 2], vec![0], vec![0]],
        vec![vec![0, 1], vec![0, 2]]
    )]
    #[case::complete_three(
        vec![vec![1, 2], vec![0, 2], vec![0, 1]],
        vec![vec![0, 1], vec![0, 1, 2], vec![0, 2, 1], vec![0, 2], vec![1, 2]]
    )]
    fn finds_every_cycle_once(#[case] edges: Vec<Vec<usize>>, #[case] expected: Vec<Vec<usize>>) {
        let mut found = elementary_cycles(&edges);
        let mut expected = expected;
        found.sort();
        expected.sort();
        assert_eq!(found, expected);
    }

    #[test]
    fn a_long_chain_closed_at_the_end_is_one_cycle_without_overflowing() {
        let n = 100_000;
        let mut edges: Vec<Vec<usize>> = (0..n).map(|i| vec![i + 1]).collect();
        edges[n - 1] = vec![0];
        let cycles = elementary_cycles(&edges);
        assert_eq!(cycles.len(), 1);
        assert_eq!(cycles[0].len(), n);
    }

    #[test]
    fn a_long_acyclic_chain_has_no_cycle() {
        let n = 100_000;
        let edges: Vec<Vec<usize>> = (0..n)
            .map(|i| if i + 1 < n { vec![i + 1] } else { vec![] })
            .collect();
        assert!(elementary_cycles(&edges).is_empty());
    }

    /// Nodes `0..n` where each node leads to the next two, closed by one edge back to 0.
    fn ladder(n: usize) -> Vec<Vec<usize>> {
        (0..n)
            .map(|i| match i {
                _ if i + 2 < n => vec![i + 1, i + 2],
                _ if i + 1 < n => vec![i + 1],
                _ => vec![0],
            })
            .collect()
    }

    #[test]
    fn every_cycle_of_a_small_ladder_is_found_with_blocking() {
        // 0 → 1 → 2 → 3 → 0 with skips 0 → 2 and 1 → 3: the paths 0-1-2-3, 0-1-3, 0-2-3 each
        // close one cycle.
        let edges = ladder(4);
        let mut found = elementary_cycles(&edges);
        found.sort();
        assert_eq!(found, vec![vec![0, 1, 2, 3], vec![0, 1, 3], vec![0, 2, 3]]);
    }

    #[test]
    fn blocking_matches_a_plain_walk_on_random_graphs() {
        // A reference without blocking (a path's every simple extension is tried), on small
        // random graphs where that is cheap: same cycles, same order.
        fn plain(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
            let n = edges.len();
            let mut out = Vec::new();
            for start in 0..n {
                let mut path = vec![start];
                let mut on = vec![false; n];
                on[start] = true;
                fn walk(
                    edges: &[Vec<usize>],
                    start: usize,
                    path: &mut Vec<usize>,
                    on: &mut [bool],
                    out: &mut Vec<Vec<usize>>,
                ) {
                    let node = *path.last().unwrap();
                    for &w in &edges[node] {
                        if w == start {
                            out.push(path.clone());
                        } else if w > start && !on[w] {
                            on[w] = true;
                            path.push(w);
                            walk(edges, start, path, on, out);
                            path.pop();
                            on[w] = false;
                        }
                    }
                }
                walk(edges, start, &mut path, &mut on, &mut out);
            }
            out
        }
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..300 {
            let n = 1 + round % 9;
            let edges: Vec<Vec<usize>> = (0..n)
                .map(|_| {
                    let mut to: Vec<usize> = (0..n).filter(|_| next() % 3 == 0).collect();
                    to.dedup();
                    to
                })
                .collect();
            assert_eq!(elementary_cycles(&edges), plain(&edges), "{edges:?}");
        }
    }
}
