//! Collectives as operations of the event layer's [`OperationCoordinator`]: with dependencies
//! on other operations, priorities, metrics and completion futures.
//!
//! [`CoordinatedCollectives`] registers each collective as an operation of the matching
//! [`OperationType`] (`AllReduce`, `Broadcast`, `Reduction`), begins it on the caller's stream
//! (which waits, on the device, for its dependencies on other streams), queues the NCCL call
//! there, and completes it, so later operations can depend on it and
//! [`OperationCoordinator::completion`] resolves when the GPU has finished it. Only the
//! coordinator's public API is used.

use std::sync::Arc;

use cuweave_driver::Stream;
use cuweave_event::{
    AsStream, EventPriority, OperationCoordinator, OperationId, OperationType, WaitFuture,
};
use cuweave_memory::Buffer;

use crate::comm::Communicator;
use crate::error::Result;
use crate::types::{NcclType, ReduceOp};

/// Runs collectives as coordinated operations (see the [module docs](self)).
///
/// ```no_run
/// use std::sync::Arc;
/// use cuweave_collective::{CommConfig, Communicator, CoordinatedCollectives, ReduceOp, UniqueId};
/// use cuweave_driver::{Context, Device, Stream, StreamFlags};
/// use cuweave_event::{EventPool, OperationCoordinator};
/// use cuweave_memory::DeviceBuffer;
///
/// # fn main() -> cuweave_collective::Result<()> {
/// let device = Device::get(0)?;
/// let comm = Communicator::init_rank(1, 0, &UniqueId::new()?, device, &CommConfig::default())?;
/// let context = Context::primary(device)?;
/// let coordinator = OperationCoordinator::new(EventPool::new(&context, 16, 16)?)?;
/// let collectives = CoordinatedCollectives::new(coordinator.clone());
/// let stream = Arc::new(Stream::new(&context, StreamFlags::NON_BLOCKING)?);
/// let mut gradients = DeviceBuffer::<f32>::from_slice(&context, &[1.0; 1024])?;
/// let id = collectives.all_reduce_in_place(&comm, &mut gradients, ReduceOp::Sum, &stream, &[])?;
/// coordinator.synchronize(id)?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct CoordinatedCollectives {
    coordinator: OperationCoordinator,
    priority: EventPriority,
}

impl CoordinatedCollectives {
    /// Collectives coordinated by `coordinator`, at normal priority.
    pub fn new(coordinator: OperationCoordinator) -> Self {
        Self {
            coordinator,
            priority: EventPriority::Normal,
        }
    }

    /// The same, registering operations at `priority`.
    pub fn with_priority(mut self, priority: EventPriority) -> Self {
        self.priority = priority;
        self
    }

    /// The coordinator.
    pub fn coordinator(&self) -> &OperationCoordinator {
        &self.coordinator
    }

    /// Registers an operation of `operation_type` after `dependencies`, begins it on `stream`,
    /// runs `queue` (which queues the collective on the stream) and completes the operation.
    /// `stream` is any [`AsStream`]: a driver stream, or a pool's `PriorityStream`, which is
    /// told ([`AsStream::note_queued_wait`]) of the dependency waits and of what `queue`
    /// queued (the buffers' tracker waits and the collective), so its pool reads it as busy
    /// until the GPU has passed them.
    ///
    /// What `begin_operation` would refuse is checked before anything is registered, by the
    /// coordinator's own rules: `stream` must belong to the context of the coordinator's event
    /// pool ([`check_stream`]), and every dependency must be queued (completed with
    /// `complete_operation`), completed, or retired ([`dependencies_queued`], one lock, no
    /// polling). So a call refused for these leaves nothing behind: no operation stuck
    /// registered, no dependency kept alive by a dependant that will never begin. A caller may
    /// retry until the dependency is queued without the coordinator growing.
    ///
    /// Any other refusal of `begin_operation` (a capture rule: on a capturing `stream`, a
    /// dependency whose completion was recorded outside the capture and is not known to have
    /// finished; a driver error) withdraws the operation it just registered
    /// ([`OperationCoordinator::cancel_operation`]) before the error is returned: a refused
    /// call never leaves an operation registered, nor its dependencies kept from retiring.
    ///
    /// When `queue` fails, nothing of it was queued (NCCL refused the call, or a check did);
    /// the operation is still completed, at a point of the stream with no work of its own,
    /// so it retires and its dependants are not stranded, and the error is returned.
    ///
    /// [`check_stream`]: OperationCoordinator::check_stream
    /// [`dependencies_queued`]: OperationCoordinator::dependencies_queued
    ///
    /// # Errors
    /// [`EventError::ForeignStream`] for a stream of another context than the coordinator's
    /// pool; `UnknownOperation` for a dependency never registered;
    /// [`EventError::DependencyNotQueued`] for one not yet queued (both refused before
    /// registering, so their `id` is [`OperationId::UNREGISTERED`]); a capture refusal from
    /// `begin_operation` (the operation withdrawn); the coordinator's other errors; `queue`'s.
    ///
    /// [`EventError::ForeignStream`]: cuweave_event::EventError::ForeignStream
    /// [`EventError::DependencyNotQueued`]: cuweave_event::EventError::DependencyNotQueued
    pub fn run<Q: AsStream>(
        &self,
        operation_type: OperationType,
        stream: &Arc<Q>,
        dependencies: &[OperationId],
        description: impl Into<String>,
        queue: impl FnOnce(&Stream) -> Result<()>,
    ) -> Result<OperationId> {
        let raw = stream.as_stream();
        self.coordinator.check_stream(raw)?;
        self.coordinator.dependencies_queued(dependencies)?;
        let id = self.coordinator.register_operation(
            operation_type,
            self.priority,
            Some(raw),
            dependencies,
            description,
        )?;
        if let Err(refused) = self.coordinator.begin_operation(id, stream) {
            // Registered a moment ago, never begun, nothing depends on it yet: withdrawn.
            if let Err(error) = self.coordinator.cancel_operation(id) {
                tracing::warn!(%error, %id, "withdrawing a collective whose begin was refused failed");
            }
            return Err(refused.into());
        }
        let queued = queue(raw);
        // The collective, and the waits its buffers' use trackers queued before it, hold the
        // stream until the GPU passes them: told once, so a pool reads its `PriorityStream` as
        // busy meanwhile. Also when `queue` failed, since the trackers' waits may be queued by
        // then (a note too many costs one stream query).
        stream.note_queued_wait();
        self.coordinator.complete_operation(id)?;
        queued.map(|()| id)
    }

    /// A future for operation `id`, from the coordinator.
    ///
    /// # Errors
    /// As [`OperationCoordinator::completion`].
    pub fn completion(&self, id: OperationId) -> Result<WaitFuture> {
        Ok(self.coordinator.completion(id)?)
    }

    /// [`Communicator::all_reduce`] as an [`OperationType::AllReduce`] operation.
    ///
    /// # Errors
    /// As [`run`](Self::run) and the collective.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce<T, S, R, Q: AsStream>(
        &self,
        comm: &Communicator,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Arc<Q>,
        dependencies: &[OperationId],
    ) -> Result<OperationId>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.run(
            OperationType::AllReduce,
            stream,
            dependencies,
            describe("ncclAllReduce", comm, send.len()),
            |s| comm.all_reduce(send, recv, op, s),
        )
    }

    /// [`Communicator::all_reduce_in_place`] as an [`OperationType::AllReduce`] operation.
    ///
    /// # Errors
    /// As [`run`](Self::run) and the collective.
    pub fn all_reduce_in_place<T: NcclType, B: Buffer<T> + ?Sized, Q: AsStream>(
        &self,
        comm: &Communicator,
        buffer: &mut B,
        op: ReduceOp,
        stream: &Arc<Q>,
        dependencies: &[OperationId],
    ) -> Result<OperationId> {
        let description = describe("ncclAllReduce", comm, buffer.len());
        self.run(
            OperationType::AllReduce,
            stream,
            dependencies,
            description,
            |s| comm.all_reduce_in_place(buffer, op, s),
        )
    }

    /// [`Communicator::broadcast`] as an [`OperationType::Broadcast`] operation.
    ///
    /// # Errors
    /// As [`run`](Self::run) and the collective.
    #[allow(clippy::too_many_arguments)]
    pub fn broadcast<T, S, R, Q: AsStream>(
        &self,
        comm: &Communicator,
        send: &S,
        recv: &mut R,
        root: usize,
        stream: &Arc<Q>,
        dependencies: &[OperationId],
    ) -> Result<OperationId>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.run(
            OperationType::Broadcast,
            stream,
            dependencies,
            describe("ncclBroadcast", comm, send.len()),
            |s| comm.broadcast(send, recv, root, s),
        )
    }

    /// [`Communicator::reduce`] as an [`OperationType::Reduction`] operation.
    ///
    /// # Errors
    /// As [`run`](Self::run) and the collective.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce<T, S, R, Q: AsStream>(
        &self,
        comm: &Communicator,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        root: usize,
        stream: &Arc<Q>,
        dependencies: &[OperationId],
    ) -> Result<OperationId>
    where
        T: NcclType,
        S: Buffer<T> + ?Sized,
        R: Buffer<T> + ?Sized,
    {
        self.run(
            OperationType::Reduction,
            stream,
            dependencies,
            describe("ncclReduce", comm, send.len()),
            |s| comm.reduce(send, recv, op, root, s),
        )
    }
}

fn describe(call: &str, comm: &Communicator, elements: usize) -> String {
    format!(
        "{call} of {elements} elements, rank {} of {}",
        comm.rank(),
        comm.size()
    )
}
