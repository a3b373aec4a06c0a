//! Unit tests of [`DependencyGraph`](super::DependencyGraph): paths, cycles, and the reverse
//! index of dependents that removal and the backward path search use.

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

/// The reverse index holds exactly the reversed edges, over the same nodes.
fn assert_index_exact(graph: &DependencyGraph) {
    let mut reversed: BTreeMap<u64, BTreeSet<u64>> = graph
        .edges
        .keys()
        .map(|&node| (node, BTreeSet::new()))
        .collect();
    for (dependent, prerequisite) in graph.edges() {
        assert!(
            graph.edges.contains_key(&prerequisite),
            "prerequisite {prerequisite} is a node"
        );
        reversed.entry(prerequisite).or_default().insert(dependent);
    }
    assert_eq!(
        graph.dependents,
        reversed,
        "dependents of {:?}",
        graph.edges()
    );
}

#[test]
fn removing_the_middle_of_a_chain_cuts_it_and_the_stage_can_come_back() {
    let mut graph = DependencyGraph::new();
    for stage in 1..5 {
        assert_eq!(graph.try_add(stage, stage - 1), Ok(true));
    }
    assert_eq!(graph.dependents(2), vec![3]);
    assert_eq!(graph.try_add(0, 4), Err(vec![0, 4, 3, 2, 1]));

    graph.remove(2);
    assert_index_exact(&graph);
    assert_eq!(graph.edges(), vec![(1, 0), (4, 3)]);
    assert_eq!(graph.len(), 4);
    assert_eq!(graph.dependents(1), Vec::<u64>::new());
    assert_eq!(graph.prerequisites(3), Vec::<u64>::new());
    assert_eq!(graph.dependents(2), Vec::<u64>::new());
    assert_eq!(graph.path(4, 0), None);
    // The chain is cut: 0 may now wait on 4.
    assert_eq!(graph.try_add(0, 4), Ok(true));
    assert_eq!(graph.dependents(4), vec![0]);

    // 2 comes back between 3 and 1: 3 -> 2 is fine, but 2 -> 1 would close
    // 2 -> 1 -> 0 -> 4 -> 3 -> 2.
    assert_eq!(graph.try_add(3, 2), Ok(true));
    assert_eq!(graph.try_add(2, 1), Err(vec![2, 1, 0, 4, 3]));
    assert_index_exact(&graph);
    assert_eq!(graph.edges(), vec![(0, 4), (1, 0), (3, 2), (4, 3)]);
    assert_eq!(graph.dependents(2), vec![3]);
    assert!(!graph.has_cycles());
    graph.add_unchecked(2, 1);
    assert_eq!(graph.cycles(), vec![vec![0, 4, 3, 2, 1]]);
    assert_index_exact(&graph);
}

#[test]
fn removing_a_side_of_a_diamond_keeps_the_other_and_its_dependents() {
    let mut graph = DependencyGraph::new();
    for (a, b) in [(1, 2), (1, 3), (2, 4), (3, 4)] {
        graph.try_add(a, b).unwrap();
    }
    assert_eq!(graph.dependents(4), vec![2, 3]);
    graph.remove(2);
    assert_index_exact(&graph);
    assert_eq!(graph.edges(), vec![(1, 3), (3, 4)]);
    assert_eq!(graph.dependents(4), vec![3]);
    assert_eq!(graph.path(1, 4), Some(vec![1, 3, 4]));

    // The bottom goes: 3 keeps its dependent and loses its prerequisite.
    graph.remove(4);
    assert_index_exact(&graph);
    assert_eq!(graph.edges(), vec![(1, 3)]);
    assert_eq!(graph.prerequisites(3), Vec::<u64>::new());
    assert_eq!(graph.dependents(3), vec![1]);
    assert_eq!(graph.len(), 2);

    // 4 comes back on top: 4 -> 1 -> 3, so 3 waiting on 4 is a cycle.
    assert_eq!(graph.try_add(4, 1), Ok(true));
    assert_eq!(graph.try_add(3, 4), Err(vec![3, 4, 1]));
    assert_eq!(graph.path(4, 3), Some(vec![4, 1, 3]));
    assert_eq!(graph.dependents(1), vec![4]);
    assert_index_exact(&graph);
}

#[test]
fn a_removed_graph_equals_one_built_without_the_node() {
    let mut graph = DependencyGraph::new();
    for (a, b) in [(1, 0), (2, 1), (3, 2), (7, 7), (7, 2), (2, 7)] {
        graph.add_unchecked(a, b);
    }
    graph.remove(7);
    let mut direct = DependencyGraph::new();
    for (a, b) in [(1, 0), (2, 1), (3, 2)] {
        direct.add_unchecked(a, b);
    }
    assert_eq!(graph, direct);
    assert_eq!(format!("{graph:?}"), format!("{direct:?}"));
    assert_eq!(graph.dependents, direct.dependents);
    assert!(!graph.has_cycles());
    // Removing a node that is not there changes nothing.
    graph.remove(42);
    assert_eq!(graph, direct);
    assert_index_exact(&graph);
}

#[test]
fn clear_forgets_the_dependents_too() {
    let mut graph = DependencyGraph::new();
    for (a, b) in [(1, 2), (2, 3), (3, 1)] {
        graph.add_unchecked(a, b);
    }
    graph.clear();
    assert!(graph.is_empty());
    assert_eq!(graph.dependents(1), Vec::<u64>::new());
    assert_eq!(graph, DependencyGraph::new());
    assert_eq!(graph.dependents, DependencyGraph::new().dependents);
    // Edges that made a cycle before are fine after.
    assert_eq!(graph.try_add(3, 1), Ok(true));
    assert_eq!(graph.try_add(1, 2), Ok(true));
    assert_eq!(graph.dependents(1), vec![3]);
    assert_eq!(graph.path(3, 2), Some(vec![3, 1, 2]));
    assert_index_exact(&graph);
}

/// `cycles` as it was before it walked inside each part: strongly connected parts found by
/// plain reachability, and each part's cycle searched in a copy of the graph restricted to it.
fn restricted_cycles(graph: &DependencyGraph) -> Vec<Vec<u64>> {
    let nodes: Vec<u64> = graph.edges.keys().copied().collect();
    let mut done = BTreeSet::new();
    let mut cycles = Vec::new();
    for &start in &nodes {
        if done.contains(&start) {
            continue;
        }
        let members: BTreeSet<u64> = nodes
            .iter()
            .copied()
            .filter(|&u| {
                copying_path(graph, start, u).is_some() && copying_path(graph, u, start).is_some()
            })
            .collect();
        done.extend(members.iter().copied());
        let self_loop = graph.prerequisites(start).contains(&start);
        if members.len() == 1 && !self_loop {
            continue;
        }
        let mut inner = DependencyGraph::new();
        for (from, to) in graph.edges() {
            if members.contains(&from) && members.contains(&to) {
                inner.add_unchecked(from, to);
            }
        }
        if members.len() == 1 {
            cycles.push(vec![start]);
            continue;
        }
        let cycle = inner
            .prerequisites(start)
            .into_iter()
            .find_map(|next| copying_path(&inner, next, start))
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

#[test]
fn random_edits_keep_the_index_exact_and_every_answer_the_reference_one() {
    // The same edits on every run: adds, checked adds, removals and an occasional clear, each
    // followed by the reference answers of paths, cycles and elementary cycles.
    let mut lcg = cuweave_test_support::lcg::Lcg::new(0x9e37_79b9_7f4a_7c15);
    let mut next = move |bound: u64| lcg.below(bound);
    for nodes in [4, 8, 16] {
        let mut graph = DependencyGraph::new();
        let mut reference: BTreeSet<(u64, u64)> = BTreeSet::new();
        for step in 0..300 {
            let (a, b) = (next(nodes), next(nodes));
            match next(20) {
                0..=7 => {
                    assert_eq!(graph.add_unchecked(a, b), reference.insert((a, b)));
                }
                8..=14 => match graph.try_add(a, b) {
                    Ok(new) => assert_eq!(new, reference.insert((a, b))),
                    Err(cycle) => {
                        assert_eq!(cycle[0], a);
                        for (i, &node) in cycle.iter().enumerate() {
                            let after = cycle[(i + 1) % cycle.len()];
                            let closing = node == a && after == b;
                            assert!(closing || reference.contains(&(node, after)));
                        }
                    }
                },
                15..=18 => {
                    graph.remove(a);
                    reference.retain(|&(x, y)| x != a && y != a);
                }
                _ => {
                    graph.clear();
                    reference.clear();
                }
            }
            assert_index_exact(&graph);
            assert_eq!(graph.edges(), reference.iter().copied().collect::<Vec<_>>());
            if step % 10 != 0 {
                continue;
            }
            for from in 0..=nodes {
                for to in 0..=nodes {
                    assert_eq!(graph.path(from, to), copying_path(&graph, from, to));
                }
                let dependents: Vec<u64> = reference
                    .iter()
                    .filter(|&&(_, y)| y == from)
                    .map(|&(x, _)| x)
                    .collect();
                assert_eq!(graph.dependents(from), dependents);
            }
            let cycles = graph.cycles();
            assert_eq!(cycles, restricted_cycles(&graph), "{:?}", graph.edges());
            assert_eq!(graph.has_cycles(), !cycles.is_empty());
            let (ids, edges) = graph.indexed();
            let whole: Vec<Vec<u64>> = cycles::elementary_cycles(&edges)
                .into_iter()
                .map(|cycle| cycle.into_iter().map(|i| ids[i]).collect())
                .collect();
            assert_eq!(graph.elementary_cycles(), whole, "{:?}", graph.edges());
        }
    }
}

#[test]
fn a_part_whose_smallest_node_waits_on_itself_reports_the_self_loop() {
    // As the restricted search did: the smallest successor inside the part is the node itself.
    let mut graph = DependencyGraph::new();
    for (a, b) in [(1, 1), (1, 2), (2, 1)] {
        graph.add_unchecked(a, b);
    }
    assert_eq!(graph.cycles(), vec![vec![1]]);
    assert_eq!(graph.cycles(), restricted_cycles(&graph));
    assert_eq!(graph.elementary_cycles(), vec![vec![1], vec![1, 2]]);
}

#[test]
fn a_hundred_thousand_stage_chain_whose_stages_are_already_nodes_is_checked_quickly() {
    // Every stage is already a node (a sink waits on all of them), so the fast answer for a
    // new stage does not apply: the forward walk from `stage - 1` would cover the whole chain
    // below it (O(n^2) to build), while the backward search from `stage` meets only the sink.
    const STAGES: u64 = 100_000;
    const SINK: u64 = u64::MAX;
    let started = std::time::Instant::now();
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
    assert_eq!(graph.dependents(0), vec![1, SINK]);
    let elapsed = started.elapsed();
    assert!(
        elapsed < std::time::Duration::from_secs(20),
        "{STAGES} stages took {elapsed:?}"
    );
}

#[test]
fn elementary_cycles_of_many_small_parts_cost_each_part_alone() {
    // 5,000 ping-pong pairs: Johnson over the whole graph ran a component search over every
    // node for each pair (O(n^2)); part by part it is linear.
    const PAIRS: u64 = 5_000;
    let mut graph = DependencyGraph::new();
    for pair in 0..PAIRS {
        graph.add_unchecked(2 * pair, 2 * pair + 1);
        graph.add_unchecked(2 * pair + 1, 2 * pair);
    }
    let started = std::time::Instant::now();
    let cycles = graph.elementary_cycles();
    let elapsed = started.elapsed();
    let expected: Vec<Vec<u64>> = (0..PAIRS).map(|p| vec![2 * p, 2 * p + 1]).collect();
    assert_eq!(cycles, expected);
    assert!(
        elapsed < std::time::Duration::from_secs(5),
        "took {elapsed:?}"
    );
}
