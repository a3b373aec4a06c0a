//! Coordinated collectives whose dependencies are not queued yet: refused before anything is
//! registered, so retrying leaves the coordinator bounded. Needs a GPU (the coordinator's event
//! pool), not NCCL: the collective is never reached.

use std::sync::Arc;

use cuweave_collective::{CollectiveError, CoordinatedCollectives};
use cuweave_driver::{Stream, StreamFlags};
use cuweave_event::{
    EventError, EventPool, EventPriority, OperationCoordinator, OperationId, OperationType,
};
use cuweave_test_support::require_gpu;

#[test]
fn retrying_on_a_dependency_not_yet_queued_strands_nothing() {
    let gpu = require_gpu!(else return);
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    let stream = Arc::new(Stream::new(&gpu.context, StreamFlags::NON_BLOCKING).expect("stream"));
    let dependency = coordinator
        .register_operation(
            OperationType::Kernel,
            EventPriority::Normal,
            Some(&stream),
            &[],
            "registered, not yet queued",
        )
        .expect("register");
    let registered = coordinator.metrics().registered;
    let mut queued = 0;
    for _ in 0..100_000 {
        let error = collectives
            .run(
                OperationType::AllReduce,
                &stream,
                &[dependency],
                "retry",
                |_| {
                    queued += 1;
                    Ok(())
                },
            )
            .expect_err("the dependency is not queued");
        assert!(
            matches!(
                error,
                CollectiveError::Event(EventError::DependencyNotQueued { id, dependency: d })
                    if d == dependency && id == OperationId::UNREGISTERED
            ),
            "{error}"
        );
    }
    assert_eq!(queued, 0, "nothing was queued");
    assert_eq!(
        coordinator.live_operations(),
        1,
        "only the dependency is live"
    );
    assert_eq!(
        coordinator.metrics().registered,
        registered,
        "nothing registered"
    );

    // Once queued, the same call runs, and everything retires.
    coordinator
        .begin_operation(dependency, &stream)
        .expect("begin");
    coordinator
        .complete_operation(dependency)
        .expect("complete");
    let id = collectives
        .run(
            OperationType::AllReduce,
            &stream,
            &[dependency],
            "after",
            |_| {
                queued += 1;
                Ok(())
            },
        )
        .expect("runs once its dependency is queued");
    assert_eq!(queued, 1);
    coordinator.synchronize(id).expect("synchronize");
    stream.synchronize().expect("stream");
    coordinator.retire_finished();
    assert_eq!(
        coordinator.live_operations(),
        0,
        "the dependency's dependant count came back down, so it retired"
    );
}
