//! Pure-logic tests of the coordinator's state: retirement, completion points, per-stream
//! polling, capture refusals, waits on retired operations.

use super::*;

fn operation(id: u64, state: OperationState, dependencies: Vec<u64>) -> Operation {
    let dependencies = dependencies
        .into_iter()
        .map(|n| OperationId::new(0, n))
        .collect();
    let mut operation =
        Operation::registered(OperationId::new(0, id), OperationType::Kernel, dependencies);
    operation.metadata.state = state;
    operation
}

#[test]
fn completed_operations_retire_only_once_nothing_depends_on_them() {
    let mut state = State::default();
    for round in 0..100_000u64 {
        // Operation `round + 1` completes while `round + 2`, registered, depends on it.
        let (done, next) = (
            OperationId::new(0, round + 1),
            OperationId::new(0, round + 2),
        );
        state.next_id = round + 2;
        let mut finished = operation(done.get(), OperationState::Completed, vec![]);
        finished.dependants = 1;
        state.operations.insert(done, finished);
        state.operations.insert(
            next,
            operation(next.get(), OperationState::Registered, vec![done.get()]),
        );
        state.try_retire(done);
        assert_eq!(state.state_of(done), Some(OperationState::Completed));
        assert!(
            state.operations.contains_key(&done),
            "a dependant still needs it"
        );
        // The dependant begins: the record goes.
        state.operations.get_mut(&done).unwrap().dependants = 0;
        state.try_retire(done);
        assert!(state.is_retired(done));
        assert_eq!(state.state_of(done), Some(OperationState::Completed));
        state.operations.remove(&next);
    }
    assert!(state.operations.is_empty(), "records stay bounded");
    assert_eq!(state.state_of(OperationId::new(0, state.next_id + 1)), None);
    // Failed operations keep their record (and error).
    state.next_id += 1;
    let failed = OperationId::new(0, state.next_id);
    state.operations.insert(
        failed,
        operation(failed.get(), OperationState::Failed, vec![]),
    );
    state.try_retire(failed);
    assert_eq!(state.state_of(failed), Some(OperationState::Failed));
}

#[test]
fn a_slow_operation_on_one_stream_does_not_hide_completions_on_another() {
    // Stream 1 runs one long operation for the whole test; stream 2 queues 10^5 operations
    // that the GPU finishes as fast as they come. `complete_operation`'s poll (every time
    // POLL_AT are queued) must see stream 2's and retire them.
    const SLOW_STREAM: u64 = 1;
    const FAST_STREAM: u64 = 2;
    let mut state = State::default();
    let slow = OperationId::new(0, 1);
    state.next_id = 1;
    let mut op = operation(1, OperationState::Queued, vec![]);
    op.metadata.stream = Some(SLOW_STREAM);
    state.operations.insert(slow, op);
    state.queued.push(SLOW_STREAM, slow);
    let mut peak = (0, 0);
    for _ in 0..100_000 {
        state.next_id += 1;
        let id = OperationId::new(0, state.next_id);
        let mut op = operation(id.get(), OperationState::Queued, vec![]);
        op.metadata.stream = Some(FAST_STREAM);
        state.operations.insert(id, op);
        state.queued.push(FAST_STREAM, id);
        if state.queued.len() >= POLL_AT {
            let finished = state.take_finished(|op| Ok(op.metadata.id != slow));
            for (id, result) in finished {
                assert!(state.decide(id, &result).is_some());
                assert_eq!(state.state_of(id), Some(OperationState::Completed));
                state.try_retire(id);
            }
        }
        peak = peak.max((state.queued.len(), state.operations.len()));
    }
    assert!(
        peak.0 <= POLL_AT && peak.1 <= POLL_AT,
        "queued and live operations stay bounded: peak {peak:?}"
    );
    assert_eq!(state.state_of(slow), Some(OperationState::Queued));
    // The slow one finishes: the next poll sees it too.
    let finished = state.take_finished(|_| Ok(true));
    for (id, result) in finished {
        state.decide(id, &result);
        state.try_retire(id);
    }
    assert_eq!((state.queued.len(), state.operations.len()), (0, 0));
}

#[test]
fn a_query_refused_during_a_capture_leaves_the_operation_queued() {
    let mut state = State {
        next_id: 2,
        ..State::default()
    };
    for id in 1..=2 {
        let mut op = operation(id, OperationState::Queued, vec![]);
        op.metadata.stream = Some(id);
        state.operations.insert(OperationId::new(0, id), op);
        state.queued.push(id, OperationId::new(0, id));
    }
    // Another thread's global-mode capture: this thread's event queries are refused.
    let refused = || {
        Err(DriverError::Graph(cuweave_driver::GraphError::Capturing {
            operation: "Event::query",
            reason: "a blocking call or event query now would invalidate the capture",
        }))
    };
    assert!(state.take_finished(|_| refused()).is_empty());
    assert_eq!(state.queued.len(), 2);
    for id in 1..=2 {
        assert_eq!(
            state.state_of(OperationId::new(0, id)),
            Some(OperationState::Queued)
        );
    }
    // The capture ended: the GPU had finished op 1; op 2's context died meanwhile.
    let finished = state.take_finished(|op| {
        if op.metadata.id.get() == 1 {
            Ok(true)
        } else {
            Err(DriverError::Cuda {
                code: 719,
                operation: "cuEventQuery",
            })
        }
    });
    for (id, result) in finished {
        state.decide(id, &result);
    }
    assert_eq!(
        state.state_of(OperationId::new(0, 1)),
        Some(OperationState::Completed)
    );
    assert_eq!(
        state.state_of(OperationId::new(0, 2)),
        Some(OperationState::Failed)
    );
}

#[test]
fn completion_of_a_completed_operation_kept_for_a_dependant_is_reached() {
    let mut state = State {
        next_id: 4,
        ..State::default()
    };
    // 1 completed but kept: 2, registered, depends on it.
    let mut kept = operation(1, OperationState::Completed, vec![]);
    kept.dependants = 1;
    state.operations.insert(OperationId::new(0, 1), kept);
    state.operations.insert(
        OperationId::new(0, 2),
        operation(2, OperationState::Registered, vec![1]),
    );
    let mut failed = operation(3, OperationState::Failed, vec![]);
    let error = EventError::TimedOut {
        timeout: std::time::Duration::from_millis(7),
    };
    failed.failure = Some(error.clone());
    state.operations.insert(OperationId::new(0, 3), failed);
    // 4 retired.
    let point = |id| state.completion_point(OperationId::new(0, id), "completion", "await");
    assert!(matches!(point(1), Ok(CompletionPoint::Reached)));
    assert!(matches!(point(3), Ok(CompletionPoint::Failed(e)) if e == error));
    assert!(matches!(point(4), Ok(CompletionPoint::Reached)));
    assert!(matches!(
        point(2),
        Err(EventError::InvalidState {
            state: "registered",
            ..
        })
    ));
    assert!(matches!(
        point(5),
        Err(EventError::UnknownOperation {
            operation: "completion",
            ..
        })
    ));
    assert_eq!(
        futures::executor::block_on(WaitFuture::failed(error.clone())),
        Err(error)
    );
}

#[test]
fn an_operation_that_retired_while_waited_for_is_blocked_on_nothing() {
    let mut state = State {
        next_id: 2,
        ..State::default()
    };
    let (dependency, waiting) = (OperationId::new(0, 1), OperationId::new(0, 2));
    state
        .operations
        .insert(dependency, operation(1, OperationState::Registered, vec![]));
    state
        .operations
        .insert(waiting, operation(2, OperationState::Registered, vec![1]));
    assert_eq!(state.blocked_on(waiting), vec![dependency]);
    // Another thread begins and completes both, and both retire, while a caller of
    // `wait_until_ready(waiting)` sleeps on the condition variable: its next look at
    // `waiting` finds no record.
    state.operations.clear();
    assert!(state.is_retired(waiting));
    assert_eq!(state.blocked_on(waiting), Vec::<OperationId>::new());
    assert_eq!(
        state.blocked_on(OperationId::new(0, 99)),
        Vec::<OperationId>::new()
    );
}

/// `begin_operation`'s rule for dependencies, which `dependencies_queued` checks before
/// anything is registered: queued, completed and retired dependencies pass; registered, begun
/// and failed ones are refused by name, with the operation they were for.
#[rstest::rstest]
#[case::registered(OperationState::Registered, false)]
#[case::begun(OperationState::Begun, false)]
#[case::failed(OperationState::Failed, false)]
#[case::queued(OperationState::Queued, true)]
#[case::completed(OperationState::Completed, true)]
fn dependencies_are_checked_by_begin_operations_rule(
    #[case] dependency_state: OperationState,
    #[case] passes: bool,
) {
    let mut state = State {
        next_id: 3,
        ..State::default()
    };
    // op#1 retired; op#2 in `dependency_state`; op#3 queued.
    state.operations.insert(
        OperationId::new(0, 2),
        operation(2, dependency_state, vec![]),
    );
    state.operations.insert(
        OperationId::new(0, 3),
        operation(3, OperationState::Queued, vec![]),
    );
    let dependencies = [
        OperationId::new(0, 1),
        OperationId::new(0, 3),
        OperationId::new(0, 2),
    ];
    for id in [OperationId::UNREGISTERED, OperationId::new(0, 7)] {
        let checked = state.check_queued(id, &dependencies, "test");
        if passes {
            assert_eq!(checked, Ok(()));
        } else {
            assert_eq!(
                checked,
                Err(EventError::DependencyNotQueued {
                    id,
                    dependency: OperationId::new(0, 2),
                })
            );
        }
    }
    assert_eq!(
        state.check_queued(OperationId::UNREGISTERED, &[OperationId::new(0, 4)], "test"),
        Err(EventError::UnknownOperation {
            operation: "test",
            id: OperationId::new(0, 4),
        })
    );
}

#[test]
fn an_unregistered_operation_is_named_as_such_in_errors() {
    let error = EventError::DependencyNotQueued {
        id: OperationId::UNREGISTERED,
        dependency: OperationId::new(0, 5),
    };
    assert_eq!(
        error.to_string(),
        "operation (not yet registered) cannot begin: its dependency op#5 has not been queued yet"
    );
    assert_eq!(OperationId::new(0, 5).to_string(), "op#5");
}

/// A cycle closed with `add_dependency` is named from its lowest id in dependency order, as
/// `detect_deadlocks` names it; an operation only waiting on a cycle (or on a begun
/// operation) is in none, and a 10^4-long chain closed into one ring is walked without
/// recursion.
#[test]
fn the_cycle_through_an_operation_is_named_in_dependency_order() {
    let mut state = State {
        next_id: 6,
        ..State::default()
    };
    // 2 -> 3 -> 4 -> 2 (each waits for the next), 5 waits for 2, 1 is queued, 6 waits for 1.
    for (id, deps) in [(2, vec![3, 1]), (3, vec![4]), (4, vec![2]), (5, vec![2])] {
        state.operations.insert(
            OperationId::new(0, id),
            operation(id, OperationState::Registered, deps),
        );
    }
    state.operations.insert(
        OperationId::new(0, 1),
        operation(1, OperationState::Queued, vec![]),
    );
    state.operations.insert(
        OperationId::new(0, 6),
        operation(6, OperationState::Registered, vec![1]),
    );
    let ring = vec![
        OperationId::new(0, 2),
        OperationId::new(0, 3),
        OperationId::new(0, 4),
    ];
    for member in [2, 3, 4] {
        assert_eq!(
            state.cycle_through(OperationId::new(0, member)).as_ref(),
            Some(&ring)
        );
    }
    for outside in [1, 5, 6, 99] {
        assert_eq!(state.cycle_through(OperationId::new(0, outside)), None);
    }
    let error = EventError::DependencyCycle {
        id: OperationId::new(0, 3),
        cycle: ring,
    };
    assert_eq!(
        error.to_string(),
        "operation op#3 can never begin: it is in the dependency cycle op#2 -> op#3 -> op#4 -> op#2"
    );

    let mut long = State::default();
    const N: u64 = 10_000;
    for id in 1..=N {
        let next = if id == N { 1 } else { id + 1 };
        long.operations.insert(
            OperationId::new(0, id),
            operation(id, OperationState::Registered, vec![next]),
        );
    }
    let cycle = long.cycle_through(OperationId::new(0, N / 2)).unwrap();
    assert_eq!(cycle.len(), N as usize);
    assert_eq!(cycle.first(), Some(&OperationId::new(0, 1)));
    assert!(
        cycle
            .windows(2)
            .all(|pair| pair[1].get() == pair[0].get() + 1)
    );
}

#[test]
fn another_coordinators_id_is_unknown_here_never_retired() {
    let state = State {
        coordinator: 2,
        next_id: 5,
        ..State::default()
    };
    // This coordinator's retired operation 3, and operation 3 of coordinator 1.
    assert_eq!(
        state.state_of(OperationId::new(2, 3)),
        Some(OperationState::Completed)
    );
    assert_eq!(state.state_of(OperationId::new(1, 3)), None);
    assert!(!state.is_retired(OperationId::new(1, 3)));
    assert_eq!(
        state.check_queued(OperationId::UNREGISTERED, &[OperationId::new(1, 3)], "test"),
        Err(EventError::UnknownOperation {
            operation: "test",
            id: OperationId::new(1, 3),
        })
    );
}

/// A queued operation on `stream`, its completion recorded eagerly or into `capture`.
fn queued_on(
    state: &mut State,
    id: u64,
    stream: u64,
    capture: Option<u64>,
) -> (OperationId, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut op = operation(id, OperationState::Queued, vec![]);
    op.metadata.stream = Some(stream);
    op.recorded = Some(match capture {
        Some(capture) => capture_waits::Recorded::Captured { capture },
        None => capture_waits::Recorded::Eager { epoch: 0 },
    });
    let counted = std::sync::Arc::clone(&calls);
    op.callbacks.push(Box::new(move |_, result| {
        assert_eq!(result, Ok(()));
        counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }));
    let id = OperationId::new(0, id);
    state.next_id = state.next_id.max(id.get());
    state.operations.insert(id, op);
    state.queued.push(stream, id);
    (id, calls)
}

/// The seventh-look probe `a_captured_steps_callback_behind_a_gated_eager_step_runs_once_the_gate_opens`
/// (and its twin beside another thread's capture), in the state: an eager step the GPU has
/// not finished (or whose query is skipped) sits in front of a captured step on one stream. A
/// poll from the front stops at it; deciding the ended capture reaches the captured step (and
/// another of the same capture on another stream) at once, runs their callbacks, and leaves
/// the eager step and another capture's step, still recording, queued and in order.
#[test]
fn an_ended_captures_operations_are_decided_behind_unfinished_eager_work() {
    const STREAM: u64 = 1;
    const SIDE: u64 = 2;
    const ENDED: u64 = 7;
    const RECORDING: u64 = 9;
    let mut state = State::default();
    let (eager, eager_calls) = queued_on(&mut state, 1, STREAM, None);
    let (captured, captured_calls) = queued_on(&mut state, 2, STREAM, Some(ENDED));
    let (other, other_calls) = queued_on(&mut state, 3, STREAM, Some(RECORDING));
    let (side, side_calls) = queued_on(&mut state, 4, SIDE, Some(ENDED));
    let active = |capture| capture == RECORDING;

    // What the capture-end watch did alone: the eager step's query says "not yet" (running,
    // or skipped during another capture), and the walk of that stream stops there.
    let finished = state.take_finished(|op| {
        if let Some(capture) = op.captured_into() {
            return Ok(!active(capture));
        }
        Ok(false)
    });
    let finished: Vec<_> = finished.into_iter().map(|(id, _)| id).collect();
    assert_eq!(
        finished,
        vec![side],
        "only the other stream's captured step"
    );
    for id in finished {
        let callbacks = state.decide(id, &Ok(())).unwrap();
        assert_eq!(completion::run_callbacks(id, callbacks, &Ok(())), 0);
        state.try_retire(id);
    }
    assert_eq!(side_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert_eq!(state.state_of(captured), Some(OperationState::Queued));

    // Deciding the ended capture reaches it behind the eager step.
    assert!(
        state.decide_captured(RECORDING, active).is_empty(),
        "a capture still recording decides nothing"
    );
    let decided = state.decide_captured(ENDED, active);
    assert_eq!(
        decided.iter().map(|(id, ..)| *id).collect::<Vec<_>>(),
        vec![captured],
        "the side step was already decided: not again"
    );
    for (id, result, callbacks) in decided {
        assert_eq!(result, Ok(()));
        assert_eq!(completion::run_callbacks(id, callbacks, &result), 0);
        state.try_retire(id);
    }
    assert_eq!(captured_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(state.is_retired(captured));
    assert!(state.decide_captured(ENDED, active).is_empty(), "once only");
    assert_eq!(side_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The eager step and the recording capture's step stay queued, in order, untouched.
    assert_eq!(state.queued.len(), 2);
    assert_eq!(state.state_of(eager), Some(OperationState::Queued));
    assert_eq!(state.state_of(other), Some(OperationState::Queued));
    assert_eq!(eager_calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    assert_eq!(other_calls.load(std::sync::atomic::Ordering::SeqCst), 0);
    // The gate opens and the other capture ends: the next poll drains the stream in order.
    let finished = state.take_finished(|_| Ok(true));
    assert_eq!(
        finished.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        vec![eager, other]
    );
    assert_eq!(state.queued.len(), 0);
}

/// Deciding ended captures keeps the books bounded over 10^5 captures, each behind an eager
/// operation that never finishes on the same stream: every captured operation is decided and
/// retires, nothing but the one eager operation stays queued or live.
#[test]
fn ended_captures_behind_a_stuck_eager_operation_retire_and_stay_bounded() {
    const STREAM: u64 = 3;
    let mut state = State::default();
    let (stuck, _) = queued_on(&mut state, 1, STREAM, None);
    let mut ran = 0;
    for capture in 0..100_000u64 {
        let (id, calls) = queued_on(&mut state, capture + 2, STREAM, Some(capture));
        // Recording: nothing decided yet.
        assert!(state.decide_captured(capture, |c| c == capture).is_empty());
        for (id, result, callbacks) in state.decide_captured(capture, |_| false) {
            completion::run_callbacks(id, callbacks, &result);
            state.try_retire(id);
        }
        ran += calls.load(std::sync::atomic::Ordering::SeqCst);
        assert!(state.is_retired(id));
        assert_eq!((state.queued.len(), state.operations.len()), (1, 1));
    }
    assert_eq!(ran, 100_000);
    assert_eq!(state.state_of(stuck), Some(OperationState::Queued));
}
