//! The graph algorithms behind [`DependencyGraph`](super::DependencyGraph), over nodes
//! numbered `0..n`: strongly connected components (Tarjan) and every elementary cycle
//! (Johnson), both iterative. Pure logic, no CUDA.

/// Every elementary cycle of the directed graph whose node `i` has edges to `edges[i]`.
///
/// Each cycle is listed once, starting at its smallest node and following the edges
/// (`[a, b, c]` means `a → b → c → a`); cycles are ordered by their first node. A self-loop is
/// the cycle `[a]`. This is Johnson's scheme: take the smallest node `s` that lies in a
/// non-trivial strongly connected component of the graph restricted to nodes `>= s`, list the
/// cycles through `s` inside that component with a depth-first walk, then go on from `s + 1`.
/// Both the component search and the walk are iterative, so long dependency chains cannot
/// overflow the stack, and acyclic parts cost one linear pass. The number of cycles itself can
/// grow exponentially with the graph's density; dependency graphs of real work have few.
pub(crate) fn elementary_cycles(edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = edges.len();
    let mut cycles = Vec::new();
    let mut on_path = vec![false; n];
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
        // (node, index of the next edge to try)
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        on_path[start] = true;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if let Some(&target) = edges[node].get(*next) {
                *next += 1;
                if target == start {
                    cycles.push(stack.iter().map(|&(node, _)| node).collect());
                } else if in_scope(target) && !on_path[target] {
                    on_path[target] = true;
                    stack.push((target, 0));
                }
            } else {
                on_path[node] = false;
                stack.pop();
            }
        }
        from = start + 1;
    }
    cycles
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
}
