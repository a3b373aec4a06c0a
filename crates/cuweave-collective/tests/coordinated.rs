//! Coordinated collectives that `begin_operation` would refuse (a dependency not queued yet, a
//! stream of another device): refused before anything is registered, so retrying leaves the
//! coordinator bounded. Needs a GPU (the coordinator's event pool; two for the stream of
//! another device), not NCCL: the collective is never reached.

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

#[test]
fn retrying_on_a_stream_of_another_device_strands_nothing() {
    let gpu = require_gpu!(else return);
    if cuweave_driver::Device::count().expect("count") < 2 {
        cuweave_test_support::skip(
            "coordinated::retrying_on_a_stream_of_another_device_strands_nothing",
            "needs a second device",
        );
        return;
    }
    let other = cuweave_driver::Context::primary(cuweave_driver::Device::get(1).expect("device"))
        .expect("context");
    let foreign = Arc::new(Stream::new(&other, StreamFlags::NON_BLOCKING).expect("stream"));
    let coordinator = OperationCoordinator::new(EventPool::new(&gpu.context, 8, 8).expect("pool"))
        .expect("coordinator");
    let collectives = CoordinatedCollectives::new(coordinator.clone());
    let mut queued = 0;
    for _ in 0..100_000 {
        let error = collectives
            .run(OperationType::AllReduce, &foreign, &[], "retry", |_| {
                queued += 1;
                Ok(())
            })
            .expect_err("the stream is not of the coordinator's context");
        assert!(
            matches!(
                error,
                CollectiveError::Event(EventError::ForeignStream { id, stream_device: 1, .. })
                    if id == OperationId::UNREGISTERED
            ),
            "{error}"
        );
    }
    assert_eq!(queued, 0, "nothing was queued");
    assert_eq!(coordinator.live_operations(), 0, "nothing stays registered");
    assert_eq!(coordinator.metrics().registered, 0, "nothing registered");
}
